"""Run one command on many hosts over SSH (paramiko), for sweeps outside Slurm.

- bounded concurrency (a thread pool of ``concurrency`` sessions);
- key authentication only (a key file, or the agent's keys), never passwords;
- host keys checked against known_hosts: an unknown host is refused unless
  ``accept_new_hosts`` (then its key is added to the file, as ssh's
  ``StrictHostKeyChecking=accept-new`` does); a changed key is always refused;
- a host that known_hosts knows, by any key type, is pinned to the types it is known
  by: only those are offered in the handshake (a host known only by an RSA key is
  connected with RSA), and a different key, or a key of another type, is refused even
  with ``accept_new_hosts``;
- a per-host deadline covering connect, handshake, authentication and the command:
  a host that accepts the TCP connection and never speaks times out, is reported,
  and the others go on;
- host aliases, ports, users and key files from an OpenSSH client config
  (``Host``/``HostName``/``Port``/``User``/``IdentityFile``/``UserKnownHostsFile``/
  ``HostKeyAlias``), the way sysadmins already describe their fleet.

``ssh_fanout`` is the sweep's use of it: the health check on every host, each answer
turned into a node result as a Slurm check job's would be (``sweep --via ssh``).

paramiko is imported only when a fan-out runs (the ``ssh`` extra).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from clusterops.errors import ClusteropsError, InputError
from clusterops.sweep.results import NodeResult, one_line, parse_times, result_from_check

log = logging.getLogger(__name__)


@dataclass
class SSHOptions:
    concurrency: int = 32
    timeout_s: float = 120.0          # whole per-host budget
    connect_timeout_s: float = 10.0   # TCP connect + SSH banner/handshake
    accept_new_hosts: bool = False
    ssh_config: Optional[str] = None  # default ~/.ssh/config when it exists
    known_hosts: Optional[str] = None  # default: UserKnownHostsFile from the config, else ~/.ssh/known_hosts
    key_filename: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = None


@dataclass
class RemoteResult:
    host: str
    exit_code: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    error: Optional[str] = None       # why no result: unknown host key, timeout, refused, auth ...
    duration_s: float = 0.0
    host_key_type: Optional[str] = None  # the server key type checked (e.g. ssh-ed25519, ssh-rsa)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


@dataclass
class HostConf:
    alias: str
    hostname: str
    port: int
    user: str
    key_files: List[str]
    known_hosts: str
    host_key_alias: Optional[str] = None

    @property
    def key_name(self) -> str:
        """The name the host key is filed under in known_hosts, as OpenSSH spells it."""
        name = self.host_key_alias or self.hostname
        return name if self.port == 22 else f"[{name}]:{self.port}"


# Key type as filed in known_hosts -> the host-key algorithms that prove it in a handshake.
HOSTKEY_ALGORITHMS = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")}


def _known_lines(path: str) -> List[tuple]:
    """(names, key type) of every plain host-key line of a known_hosts file, including key
    types paramiko cannot load (it skips those silently; a host known only by such a key
    is still known, and must not be taken for a new one)."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                fields = line.split()
                if not fields or fields[0].startswith("#") or len(fields) < 3:
                    continue
                if fields[0].startswith("@"):
                    continue   # @cert-authority / @revoked: not a host's own key
                out.append((fields[0].split(","), fields[1]))
    except OSError:
        pass
    return out


def _name_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("|1|"):
        import paramiko

        try:
            salt = pattern.split("|")[2]
            return paramiko.HostKeys.hash_host(name, salt) == pattern
        except Exception:   # a damaged hashed entry matches nothing
            return False
    return pattern == name


class HostKeyStore:
    """known_hosts loaded once, shared by all threads; new keys appended under a lock."""

    def __init__(self, path: str, accept_new: bool):
        import paramiko

        self.path = os.path.expanduser(path)
        self.accept_new = accept_new
        self.keys = paramiko.HostKeys()
        if os.path.exists(self.path):
            if os.path.isdir(self.path):
                raise InputError(f"{self.path}: known_hosts is a directory")
            try:
                self.keys.load(self.path)
            except (OSError, paramiko.SSHException, ValueError, UnicodeDecodeError) as e:
                raise ClusteropsError(f"{self.path}: cannot read known_hosts: {e}") from None
        self.lines = _known_lines(self.path)
        self.lock = threading.Lock()

    def known_types(self, name: str) -> List[str]:
        """Every key type ``name`` is filed under (loadable by paramiko or not)."""
        with self.lock:
            known = self.keys.lookup(name)
            types = list(known.keys()) if known is not None else []
            for names, kind in self.lines:
                if kind not in types and any(_name_matches(p, name) for p in names):
                    types.append(kind)
            return types

    def pin(self, name: str, security_options) -> Optional[str]:
        """Offer only the host-key algorithms of the types ``name`` is known by (none
        changed for an unknown host). Returns why the host cannot be checked, or None."""
        types = self.known_types(name)
        if not types:
            return None
        wanted = [a for t in types for a in HOSTKEY_ALGORITHMS.get(t, (t,))]
        offered = [a for a in security_options.key_types if a in wanted]
        if not offered:
            return (f"host {name} is known only by key type(s) {', '.join(types)}, which clusterops cannot "
                    "check: refused")
        security_options.key_types = offered
        return None

    def verify(self, name: str, key) -> Optional[str]:
        """None when the key is trusted (or newly accepted); else why it is refused."""
        with self.lock:
            known = self.keys.lookup(name)
            kind = key.get_name()
            types = list(known.keys()) if known is not None else []
            types += [k for names, k in self.lines if k not in types and any(_name_matches(p, name) for p in names)]
            if kind in types:
                if known is not None and kind in known and known[kind] == key:
                    return None
                return (f"host key for {name} has CHANGED ({kind} {key.get_base64()[:16]}...): "
                        "refused (possible man-in-the-middle; fix known_hosts if the host was reinstalled)")
            if types:
                return (f"host key for {name} is {kind}, but known_hosts pins it to {', '.join(types)}: "
                        "refused (possible man-in-the-middle; fix known_hosts if the host was reinstalled)")
            if not self.accept_new:
                return (f"unknown host key for {name} ({kind}): refused; add it to {self.path} "
                        "or rerun with --accept-new-hosts")
            self.keys.add(name, kind, key)
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            # Start on a new line even if the file's last line has no newline.
            sep = ""
            try:
                with open(self.path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    if f.tell() > 0:
                        f.seek(-1, os.SEEK_END)
                        sep = "" if f.read(1) == b"\n" else "\n"
            except OSError:
                pass
            with open(self.path, "a") as f:
                f.write(f"{sep}{name} {kind} {key.get_base64()}\n")
            log.warning("accepted new host key for %s (%s)", name, kind)
            return None


def resolve_hosts(hosts: Sequence[str], opts: SSHOptions) -> List[HostConf]:
    import paramiko

    cfg = paramiko.SSHConfig()
    cfg_path = os.path.expanduser(opts.ssh_config or "~/.ssh/config")
    if os.path.exists(cfg_path):
        try:
            cfg = paramiko.SSHConfig.from_path(cfg_path)
        except Exception as e:  # paramiko raises several types for a bad config
            raise InputError(f"{cfg_path}: cannot parse ssh config: {e}") from None
    elif opts.ssh_config:
        raise InputError(f"--ssh-config: {cfg_path}: no such file")
    out = []
    for h in hosts:
        c = cfg.lookup(h)
        keys = [opts.key_filename] if opts.key_filename else list(c.get("identityfile", []))
        known = opts.known_hosts or (c.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0]
        port = opts.port or int(c.get("port", 22))
        out.append(HostConf(alias=h, hostname=c.get("hostname", h), port=port,
                            user=opts.user or c.get("user") or getpass.getuser(),
                            key_files=[os.path.expanduser(k) for k in keys],
                            known_hosts=os.path.expanduser(known), host_key_alias=c.get("hostkeyalias")))
    return out


def _load_keys(paths: Sequence[str]):
    import paramiko

    keys = []
    for p in paths:
        if not os.path.exists(p):
            continue
        for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
            try:
                keys.append(cls.from_private_key_file(p))
                break
            except paramiko.SSHException:
                continue
            except OSError as e:
                raise ClusteropsError(f"{p}: cannot read ssh key: {e}") from None
    return keys


class _Deadline(Exception):
    pass


def run_one(hc: HostConf, command: str, store: HostKeyStore, keys, opts: SSHOptions,
            clock: Callable[[], float] = time.monotonic) -> RemoteResult:
    """``command`` on one host, within ``opts.timeout_s`` in all: connect, handshake (host
    key pinned and verified), key authentication, then the command's output and exit."""
    import paramiko

    start = clock()
    deadline = start + opts.timeout_s
    res = RemoteResult(hc.alias)
    sock = transport = None

    def left(cap: Optional[float] = None) -> float:
        rem = deadline - clock()
        if rem <= 0:
            raise _Deadline()
        return min(rem, cap) if cap else rem

    try:
        try:
            sock = socket.create_connection((hc.hostname, hc.port), timeout=left(opts.connect_timeout_s))
        except socket.timeout:
            raise _Deadline() from None
        except OSError as e:
            res.error = f"connect to {hc.hostname}:{hc.port}: {e.strerror or e}"
            return res
        transport = paramiko.Transport(sock)
        res.host_key_type, res.error = _handshake(transport, hc, store, opts, left, clock)
        if res.error:
            return res
        if not _authenticate(transport, hc, keys):
            res.error = f"key authentication as {hc.user} refused (keys tried: {len(keys)})"
            return res
        res.exit_code, res.stdout, res.stderr = _execute(transport, command, left)
        return res
    except _Deadline:
        res.error = (f"timed out after {clock() - start:.1f}s (no answer from {hc.hostname}:{hc.port}; "
                     f"connect timeout {opts.connect_timeout_s:g}s, host timeout {opts.timeout_s:g}s)")
        return res
    except (paramiko.SSHException, OSError, EOFError) as e:
        res.error = f"ssh to {hc.hostname}:{hc.port}: {e}"
        return res
    finally:
        res.duration_s = clock() - start
        if transport is not None:
            transport.close()
        elif sock is not None:
            sock.close()


def _handshake(transport, hc: HostConf, store: HostKeyStore, opts: SSHOptions, left: Callable[..., float],
               clock: Callable[[], float]) -> Tuple[Optional[str], Optional[str]]:
    """The SSH handshake with the host key types pinned, then the server's key verified.
    -> (the server key's type, ``None`` when the host is who known_hosts says, else why
    not). Time running out is ``_Deadline``."""
    import paramiko

    why = store.pin(hc.key_name, transport.get_security_options())
    if why:
        return None, why
    pinned = store.known_types(hc.key_name)
    transport.banner_timeout = left(opts.connect_timeout_s)
    transport.handshake_timeout = left(opts.connect_timeout_s)
    hs_start = clock()
    hs_budget = left(opts.connect_timeout_s)
    try:
        transport.start_client(timeout=hs_budget)
    except (paramiko.SSHException, EOFError, OSError) as e:
        # paramiko words a handshake timeout in several ways ("No existing session",
        # banner errors); what counts is that the time ran out.
        if clock() - hs_start >= hs_budget * 0.95 or isinstance(e, socket.timeout):
            raise _Deadline() from None
        if pinned and "host key" in str(e).lower():
            return None, (f"host key for {hc.key_name}: the server offers no {', '.join(pinned)} key, the "
                          f"type(s) known_hosts pins: refused (possible man-in-the-middle; fix known_hosts "
                          f"if the host was reinstalled)")
        return None, f"ssh handshake with {hc.hostname}:{hc.port} failed: {e}"
    try:
        # start_client returns quietly when its timeout passes: no server key then.
        server_key = transport.get_remote_server_key()
    except paramiko.SSHException as e:
        if clock() - hs_start >= hs_budget * 0.95:
            raise _Deadline() from None
        return None, f"ssh handshake with {hc.hostname}:{hc.port} failed: {e}"
    return server_key.get_name(), store.verify(hc.key_name, server_key)


def _authenticate(transport, hc: HostConf, keys) -> bool:
    """Public-key authentication as ``hc.user``: the given keys first, then the agent's."""
    import paramiko

    def try_keys(candidates) -> bool:
        for k in candidates:
            try:
                transport.auth_publickey(hc.user, k)
            except paramiko.AuthenticationException:
                continue
            if transport.is_authenticated():
                return True
        return False

    def agent_keys():
        try:
            return paramiko.Agent().get_keys()
        except Exception:
            return ()

    return try_keys(keys) or try_keys(agent_keys())


def _execute(transport, command: str, left: Callable[..., float]) -> Tuple[int, str, str]:
    """Run ``command`` on an authenticated transport; read its output until it exits (or the
    host's time runs out: ``_Deadline``). -> (exit code, stdout, stderr)."""
    chan = transport.open_session(timeout=left())
    chan.settimeout(0.5)
    chan.exec_command(command)
    out, err = [], []
    eof = False
    while True:
        left()
        if not eof:
            try:
                data = chan.recv(65536)
                if data:
                    out.append(data)
                else:
                    eof = True
            except socket.timeout:
                pass
        while chan.recv_stderr_ready():
            err.append(chan.recv_stderr(65536))
        if eof:
            if chan.exit_status_ready():
                while chan.recv_stderr_ready():
                    err.append(chan.recv_stderr(65536))
                break
            chan.status_event.wait(0.2)
    return chan.recv_exit_status(), b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace")


def fan_out(hosts: Sequence[str], command: str, opts: SSHOptions,
            on_result: Optional[Callable[[RemoteResult], None]] = None) -> Dict[str, RemoteResult]:
    """Run ``command`` (a remote shell command line) on every host; a result per host."""
    import importlib.util

    if importlib.util.find_spec("paramiko") is None:
        raise ClusteropsError("--via ssh needs paramiko: pip install 'clusterops[ssh]'")
    # paramiko's transport threads log a traceback for every connection we abandon (a
    # silent host after its timeout); the result already carries the reason.
    logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
    if opts.concurrency < 1:
        raise InputError(f"--concurrency: must be at least 1, got {opts.concurrency}")
    confs = resolve_hosts(hosts, opts)
    stores: Dict[str, HostKeyStore] = {}
    keycache: Dict[tuple, list] = {}
    for hc in confs:
        if hc.known_hosts not in stores:
            stores[hc.known_hosts] = HostKeyStore(hc.known_hosts, opts.accept_new_hosts)
        kt = tuple(hc.key_files)
        if kt not in keycache:
            keycache[kt] = _load_keys(hc.key_files)
    results: Dict[str, RemoteResult] = {}
    lock = threading.Lock()

    def one(hc: HostConf) -> None:
        try:
            r = run_one(hc, command, stores[hc.known_hosts], keycache[tuple(hc.key_files)], opts)
        except Exception as e:  # one host's surprise must not end the fan-out
            r = RemoteResult(hc.alias, error=f"{type(e).__name__}: {e}")
        with lock:
            results[hc.alias] = r
        if on_result:
            on_result(r)

    with ThreadPoolExecutor(max_workers=min(opts.concurrency, max(1, len(confs)))) as pool:
        list(pool.map(one, confs))
    return results


# -- the sweep over SSH ------------------------------------------------------------------

def ssh_fanout(targets: Sequence[str], argv: Sequence[str], opts,
               on_result: Optional[Callable[[NodeResult], None]] = None) -> Dict[str, NodeResult]:
    """The sweep over SSH: the check on every host (bounded by ``opts``, a SweepOptions),
    each answer judged like a Slurm check job's; a host SSH cannot reach is ``unreachable``."""
    results: Dict[str, NodeResult] = {}
    lock = threading.Lock()
    # bash's `times` gives the check's CPU time, as in Slurm jobs.
    command = "{ " + shlex.join(list(argv)) + "; rc=$?; times >&2; exit $rc; }"
    remote = shlex.join(["bash", "-c", command])

    def one(res: RemoteResult) -> None:
        if res.error:
            r = NodeResult(res.host, "unreachable", detail=one_line(f"ssh: {res.error}"), probe="ssh",
                           latency_s=round(res.duration_s, 3))
        else:
            try:
                doc = json.loads(res.stdout)
            except ValueError:
                doc = None
            r = result_from_check(res.host, doc, res.exit_code, stderr=res.stderr)
            r.cpu_s = parse_times("\n".join(res.stderr.strip().splitlines()[-2:]))
            r.latency_s = round(res.duration_s, 3)
        with lock:
            results[r.node] = r
        if on_result:
            on_result(r)

    fan_out(list(targets), remote, SSHOptions(
        concurrency=opts.concurrency, timeout_s=opts.timeout_s, connect_timeout_s=opts.connect_timeout_s,
        accept_new_hosts=opts.accept_new_hosts, ssh_config=opts.ssh_config, known_hosts=opts.known_hosts,
        key_filename=opts.ssh_key, user=opts.ssh_user, port=opts.ssh_port), on_result=one)
    return results
