"""TLS in front of a plain TCP service, as a site's TLS-terminating proxy puts it in front of
slurmrestd: a throwaway CA and server certificates (the ``openssl`` CLI), and a forwarder.

``make_pki(folder)`` writes a CA (``ca.pem``) and two certificates it signed: ``server``
for ``IP:127.0.0.1`` and ``other`` for ``DNS:slurmrestd.example.org`` only (a host name
mismatch for a client that dials 127.0.0.1). ``TlsForwarder(cert, key, upstream_port)``
listens on 127.0.0.1 (a free port), completes the TLS handshake of each client, connects
to 127.0.0.1:``upstream_port`` and pumps bytes both ways until either side closes, then
closes both (a ``close_notify`` to the client). It keeps the handshakes the client refused
(``refused``: what OpenSSL said here), counts the connections it forwarded (``forwarded``)
and keeps anything else that went wrong (``errors``). ``with`` it, or ``close()``: the listener and every
open connection end, and their threads are joined.
"""

from __future__ import annotations

import select
import shutil
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

_CA_CONF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = clusterops test CA
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
"""
_LEAF_EXT = """\
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
subjectAltName = {san}
"""


@dataclass(frozen=True)
class Pki:
    ca: Path            # the CA's certificate (PEM): what a client must trust
    server: Path        # certificate for IP:127.0.0.1
    server_key: Path
    other: Path         # certificate for DNS:slurmrestd.example.org only
    other_key: Path


def _openssl(folder: Path, *args: str) -> None:
    out = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise RuntimeError(f"openssl {' '.join(args)}: {out.stderr.strip()[-400:]}")


def make_pki(folder: Path) -> Pki:
    """A P-256 CA and two leaf certificates it signed, valid for a day, under ``folder``."""
    if shutil.which("openssl") is None:
        raise FileNotFoundError("openssl")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.cnf").write_text(_CA_CONF)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(folder, "req", "-x509", "-config", "ca.cnf", "-extensions", "ca", *key, "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "1")
    for serial, name, san in ((1, "server", "IP:127.0.0.1"), (2, "other", "DNS:slurmrestd.example.org")):
        (folder / f"{name}.ext").write_text(_LEAF_EXT.format(san=san))
        _openssl(folder, "req", "-new", "-config", "ca.cnf", *key, "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={san.split(':', 1)[1]}")
        _openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-set_serial", str(serial), "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return Pki(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "other.pem",
               folder / "other.key")


class TlsForwarder:
    def __init__(self, cert: Path, key: Path, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(str(cert), str(key))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self.forwarded = 0
        self.refused: List[str] = []
        self.errors: List[str] = []        # anything else that went wrong here
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="tls-forwarder", daemon=True)
        self._accepter.start()

    def __enter__(self) -> "TlsForwarder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._accepter.join(10)
        for t in list(self._threads):
            t.join(10)
        self._listener.close()
        alive = [t.name for t in self._threads + [self._accepter] if t.is_alive()]
        assert not alive, f"the forwarder's threads did not end: {alive}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                self._note(self.errors, f"accept: {e}")
                return
            t = threading.Thread(target=self._serve, args=(conn,), name=f"tls-conn-{len(self._threads)}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def _note(self, where: List[str], text: str) -> None:
        with self._lock:
            where.append(text)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            tls = self._ctx.wrap_socket(conn, server_side=True)
        except OSError as e:        # ssl.SSLError: what the client's alert said
            self._note(self.refused, getattr(e, "reason", None) or f"{type(e).__name__}: {e}")
            conn.close()
            return
        try:
            up = socket.create_connection(self.upstream, timeout=10)
        except OSError as e:
            self._note(self.errors, f"upstream {self.upstream}: {e}")
            tls.close()
            return
        with self._lock:
            self.forwarded += 1
        try:
            self._pump(tls, up)
        except OSError as e:
            self._note(self.errors, f"pump: {type(e).__name__}: {e}")
        finally:
            up.close()
            try:
                tls.unwrap()       # close_notify, where the client is still there to read it
            except (OSError, ValueError):
                pass
            tls.close()

    def _pump(self, tls: ssl.SSLSocket, up: socket.socket) -> None:
        """Bytes both ways until one side closes or the forwarder stops. Decrypted bytes may
        wait in the TLS object (``pending``) where ``select`` cannot see them."""
        while not self._stop.is_set():
            ready = [tls] if tls.pending() else select.select([tls, up], [], [], 0.2)[0]
            for src in ready:
                dst: Optional[socket.socket] = up if src is tls else tls
                try:
                    data = src.recv(65536)
                except ssl.SSLWantReadError:
                    continue
                if not data:
                    return
                dst.sendall(data)
