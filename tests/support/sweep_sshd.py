"""A real OpenSSH server on 127.0.0.1 for the SSH sweep tests and the fan-out benchmark,
plus a 'silent host': a port that accepts connections and never says a word."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional
from clusterops.runner import free_port

SSHD = "/usr/sbin/sshd"


class Sshd:
    """``/usr/sbin/sshd -D`` with its own host key, config, authorized keys and pid file."""

    def __init__(self, root: Path, host_key_types=("ed25519",)):
        self.root = Path(root)
        # The first type's key is "hostkey" (as before); others are "hostkey_<type>".
        self.host_key_types = tuple(host_key_types)
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None

    @staticmethod
    def available() -> bool:
        return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None

    def start(self, max_startups: int = 200) -> "Sshd":
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)     # sshd's privilege-separation directory
        for name, kind in [("client_key", "ed25519")] + [(self._key_file(t), t) for t in self.host_key_types]:
            if not (r / name).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(r / name)]
                               + (["-b", "2048"] if kind == "rsa" else []), check=True)
        host_keys = "".join(f"HostKey {r}/{self._key_file(t)}\n" for t in self.host_key_types)
        (r / "authorized_keys").write_text((r / "client_key.pub").read_text())
        self.port = free_port("127.0.0.1")
        (r / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\n{host_keys}"
            f"AuthorizedKeysFile {r}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PidFile {r}/sshd.pid\nMaxStartups {max_startups}:30:{max_startups * 2}\nMaxSessions 100\n"
            "LogLevel ERROR\nPrintMotd no\nAcceptEnv CLUSTEROPS_*\n")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(r / "sshd_config"), "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=open(r / "sshd.log", "ab"),
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(r / 'sshd.log').read_text()[-500:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError("sshd did not start listening")

    def _key_file(self, kind: str) -> str:
        return "hostkey" if kind == self.host_key_types[0] else f"hostkey_{kind}"

    def host_key_line(self, name: str, kind: Optional[str] = None) -> str:
        """The known_hosts line of this server's key of ``kind`` (default: its first)."""
        pub = self.root / (self._key_file(kind or self.host_key_types[0]) + ".pub")
        kind_name, b64 = pub.read_text().split()[:2]
        return f"{name} {kind_name} {b64}\n"

    def write_client_files(self, hosts: List[str], known: bool = True, extra_config: str = "",
                           suffix: str = "") -> dict:
        """An ssh config mapping each alias to this server, and a known_hosts with (or without)
        its key. Returns paths."""
        r = self.root
        cfg = r / f"ssh_config{suffix}"
        kh = r / f"known_hosts{suffix}"
        cfg.write_text(f"Host {' '.join(hosts)}\n    HostName 127.0.0.1\n    Port {self.port}\n    User root\n"
                       f"    IdentityFile {r}/client_key\n    UserKnownHostsFile {kh}\n" + extra_config)
        kh.write_text(self.host_key_line(f"[127.0.0.1]:{self.port}") if known else "")
        return {"ssh_config": str(cfg), "known_hosts": str(kh), "key": str(r / "client_key")}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


class SilentHost:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte (a hung sshd, a
    black-holed host behind a NAT that still completes the handshake)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: List[socket.socket] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stopping:
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)
            except OSError:
                continue

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()
