"""The supervisor's end of the heartbeat channel: a UDP receiver and the file fallback.

The ranks report per node (:mod:`clusterops.heartbeat`). For each attempt the supervisor
opens a :class:`Channel`: a :class:`Receiver` thread takes the nodes' datagrams on a UDP
port of the batch host (the address, with a fresh token, goes to the ranks as
``protocol.ENV_HEARTBEAT_ADDR``), and :meth:`Channel.snapshot` gives the watch loop the same
rank -> (step, time of progress) map the per-rank files gave, for ``sv.Heartbeats``.

The fallback rule: while every expected rank was heard over the network within
``fallback_after_s``, the shared filesystem is not touched. Otherwise (the start, a node
whose datagrams do not arrive, the ``file`` mode) the heartbeat directory is scanned once
-- the per-node files a sender writes when it cannot send, and per-rank files of scripts
on the old channel -- and the newer report of each rank wins. So a node cut off from the
supervisor's port costs one file per interval, and a hung rank is still named by rank.

The channel is two-way: the receiver answers each ping of the ranks' supervisor watch
(:mod:`clusterops.watchdog`, one per node and interval) with a beacon, from the receiving
thread itself, so a watch loop held up by a slow controller still answers in milliseconds.
The beacon says how long a silence means "gone" (``CLUSTEROPS_SUPERVISOR_LOST_S``, default
:data:`LOST_DEFAULT_S`; keep it well under ``SlurmdTimeout``: the ranks must requeue before
Slurm ends their step for the lost batch host).

The channel mode is a setting of the supervisor (``CLUSTEROPS_SUPERVISE_HEARTBEAT``):
``net`` (default), ``file`` (the per-node files only: the forced fallback), ``rank-files``
(the old channel: one file per rank, read every poll).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import select
import socket
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from clusterops import heartbeat as hbc
from clusterops import protocol
from clusterops.errors import InputError

MODE_ENV = "CLUSTEROPS_SUPERVISE_HEARTBEAT"
MODES = ("net", "file", "rank-files")
RCVBUF_BYTES = 8 << 20
#: How long the receiver lets datagrams gather between drains (receive times are this
#: coarse; heartbeats come once a second and hangs are timed in tens of seconds).
DRAIN_S = 0.02

Beats = Dict[int, Tuple[int, float]]

LOST_ENV = "CLUSTEROPS_SUPERVISOR_LOST_S"
LOST_DEFAULT_S = 10.0


def lost_from_env(environ=os.environ) -> float:
    """The silence after which the ranks take the supervisor for gone (seconds)."""
    text = (environ.get(LOST_ENV) or "").strip()
    if not text:
        return LOST_DEFAULT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 1.0 <= value <= 86400.0:
        raise InputError(f"{LOST_ENV}={text!r}: must be a number of seconds from 1 to 86400")
    return value


def mode_from_env(environ=os.environ) -> str:
    mode = (environ.get(MODE_ENV) or "net").strip()
    if mode not in MODES:
        raise InputError(f"{MODE_ENV}={mode!r}: must be one of {', '.join(MODES)}")
    return mode


def _udp_socket(host: str, port: int = 0) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        try:    # room for a second of datagrams from thousands of nodes (the kernel may cap it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        except OSError:
            pass
        sock.bind((host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Receiver:
    """A thread that takes heartbeat datagrams on a UDP socket and keeps, per rank, the
    latest (step, time of progress, step_ms, time received) and its busy_ms, and per node the time heard.

    Bound to ``bind_host`` (the address the ranks were given; "" is every interface). Any
    local user can send to the port: a datagram is checked for size, token and nesting
    before it is parsed (:func:`clusterops.heartbeat.decode`), and nothing a datagram holds
    ends the thread (what cannot be taken is counted in ``dropped``). Should the thread end
    all the same (a bug, the socket gone), :attr:`alive` says so, :attr:`error` says why,
    and :meth:`restart` starts it again on the same port; the supervisor does both."""

    def __init__(self, token: str, *, bind_host: str = "", port: int = 0, clock: Callable[[], float] = time.time,
                 lost_after_s: float = LOST_DEFAULT_S):
        self.token = token
        self.lost_ms = max(1, round(1000 * lost_after_s))
        self.beacons = 0          # pings answered
        self.dump = 0             # the latest flight-recorder dump request (carried by every beacon)
        self.clock = clock
        self.bind_host = bind_host
        self.sock = _udp_socket(bind_host, port)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.ranks: Dict[int, Tuple[int, float, int, float]] = {}
        self.busy: Dict[int, int] = {}     # rank -> busy_ms of the beat in ranks (-1: not known)
        self.signals: Dict[int, Tuple[int, Optional[float], Optional[float]]] = {}   # rank -> (step, loss, gnorm)
        self.nodes: Dict[str, float] = {}
        self.received = 0
        self.dropped = 0          # undecodable, too big or deep, another version, another token
        self.restarts = 0         # times restart() started the thread again
        self.error = ""           # why the thread ended on its own ("": it did not)
        self._stop = threading.Event()
        self._thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="clusterops-heartbeats", daemon=True)

    def start(self) -> "Receiver":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the receiving thread runs (False once it ended, or before start)."""
        return self._thread.is_alive()

    def restart(self) -> None:
        """Start the thread again after it ended; on the same socket when that is still
        open, else on a new one bound to the same address and port (the ranks know only
        that one). OSError when the port cannot be had again."""
        if self.alive or self._stop.is_set():
            return
        if self.sock.fileno() < 0:
            self.sock = _udp_socket(self.bind_host, self.port)
        self.restarts += 1
        self.error = ""
        self._thread = self._new_thread()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.sock.close()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - said in .error; the supervisor restarts the thread
            self.error = f"{type(e).__name__}: {e}"
            return
        if not self._stop.is_set():
            self.error = self.error or "the receiver stopped"

    def _loop(self) -> None:
        # Wait until something arrives, take everything queued, then let the next
        # datagrams gather for DRAIN_S: tens of wake-ups a second instead of one per
        # datagram (2,048 a second at 2,048 nodes), each a poll and a GIL hand-over with
        # the watch loop. The kernel's receive buffer holds the datagrams meanwhile.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
            except InterruptedError:
                continue
            now = self.clock()
            while True:
                try:
                    data, src = self.sock.recvfrom(hbc.MAX_DATAGRAM + 1)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    if not self._stop.is_set():
                        self.error = f"receiving: {e}"
                    return
                try:
                    if hbc.PING_MARK in data:
                        self.answer(data, src)
                    else:
                        self.feed(data, now)
                except Exception:  # noqa: BLE001 - no datagram may end the receiver
                    self.dropped += 1
            self._stop.wait(DRAIN_S)

    def answer(self, data: bytes, src) -> bool:
        """Answer a ping (the ranks' supervisor watch) with a beacon to ``src``, from this
        thread; False when ``data`` is not this attempt's ping."""
        try:
            d = hbc.decode(data, self.token)
        except hbc.BadDatagram:
            self.dropped += 1
            return False
        if d.kind != hbc.KIND_PING:
            return self.feed(data, self.clock())
        self.beacons += 1
        try:
            self.sock.sendto(hbc.encode_beacon(self.token, d.seq, self.lost_ms, self.dump), src)
        except OSError:
            pass            # the rank's socket is gone; its next ping asks again
        return True

    def feed(self, data: bytes, now: float) -> bool:
        """Take one datagram received at ``now``; False when it is dropped (a ping carries
        no beats: taken, nothing recorded)."""
        try:
            d = hbc.decode(data, self.token)
        except hbc.BadDatagram:
            self.dropped += 1
            return False
        if d.kind == hbc.KIND_PING:
            return True
        with self.lock:
            self.received += 1
            self.nodes[d.node] = now
            for b in d.ranks:
                t = now - b.age_ms / 1000.0
                old = self.ranks.get(b.rank)
                if old is None or t >= old[1]:
                    self.ranks[b.rank] = (b.step, t, b.step_ms, now)
                    self.busy[b.rank] = b.busy_ms
                    if b.loss is not None or b.grad_norm is not None:
                        self.signals[b.rank] = (b.step, b.loss, b.grad_norm)
                else:
                    self.ranks[b.rank] = old[:3] + (now,)
        return True

    def snapshot(self) -> Dict[int, Tuple[int, float, int, float]]:
        with self.lock:
            return dict(self.ranks)

    def timings(self) -> Dict[int, Tuple[int, int, int]]:
        """rank -> (step, step_ms, busy_ms) of its latest beat."""
        with self.lock:
            return {r: (v[0], v[2], self.busy.get(r, -1)) for r, v in self.ranks.items()}


def bind_address(host: str) -> Tuple[str, str, str]:
    """Where to listen for ranks told to send to ``host``: (address to bind, address to give
    the ranks, why "" -- every interface -- instead). An IP address is bound as it is. A
    name is resolved here, and its one address is both bound and given to the ranks, so
    that they send exactly where the receiver listens; a name that resolves to a loopback
    address here (Debian's ``127.0.1.1 <hostname>``), to several, or to none is given as
    it is, with the receiver on every interface."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host.strip("[]"), host.strip("[]"), ""
    except ValueError:
        pass
    try:
        found = sorted({info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)})
    except (OSError, UnicodeError) as e:
        return "", host, f"cannot resolve {host}: {e}"
    if len(found) != 1:
        return "", host, f"{host} resolves to {', '.join(found)} here"
    if ipaddress.ip_address(found[0]).is_loopback:
        return "", host, f"{host} resolves to the loopback address {found[0]} here, which other nodes cannot reach"
    return found[0], found[0], ""


class Channel:
    """One attempt's heartbeat channel, supervisor side."""

    def __init__(self, mode: str, hb_dir: os.PathLike, *, advertise_host: str = "127.0.0.1",
                 fallback_after_s: float = 3.0, clock: Callable[[], float] = time.time,
                 lost_after_s: Optional[float] = None):
        if mode not in MODES:
            raise InputError(f"heartbeat channel {mode!r}: must be one of {', '.join(MODES)}")
        self.mode = mode
        self.hb_dir = hb_dir
        self.fallback_after_s = fallback_after_s
        self.clock = clock
        self.receiver: Optional[Receiver] = None
        self.addr = ""
        #: Why the receiver listens on every interface rather than on ``advertise_host``
        #: alone ("": it does not); for the timeline.
        self.bind_fallback = ""
        lost = lost_from_env() if lost_after_s is None else lost_after_s
        if mode == "net":
            token = secrets.token_hex(16)
            # Listen where the ranks send (the batch host's address), not on every interface;
            # the wildcard only when that address is not this host's to bind.
            bind, advertise_host, self.bind_fallback = bind_address(advertise_host)
            receiver = None
            if bind:
                try:
                    receiver = Receiver(token, bind_host=bind, clock=clock, lost_after_s=lost)
                except (OSError, OverflowError) as e:
                    self.bind_fallback = f"cannot bind {bind}: {getattr(e, 'strerror', None) or e}"
            if receiver is None:
                receiver = Receiver(token, bind_host="::" if ":" in advertise_host else "", clock=clock,
                                    lost_after_s=lost)
            self.receiver = receiver.start()
            host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
            self.addr = f"{host}:{self.receiver.port}/{token}"
        elif mode == "file":
            self.addr = f"{protocol.HEARTBEAT_ADDR_FILE}/{secrets.token_hex(16)}"
        self.file_scans = 0           # times the heartbeat directory was read
        self.files_read = 0           # files read in those scans
        self.file_timing: Dict[int, Tuple[int, int, int]] = {}   # rank -> (step, step_ms, busy_ms), files
        self.file_signals: Dict[int, Tuple[int, Optional[float], Optional[float]]] = {}   # (step, loss, gnorm)

    def revive(self) -> Optional[str]:
        """Restart the receiver when its thread ended; None when it runs (or there is none),
        else what happened, for the timeline. OSError when it cannot be restarted."""
        r = self.receiver
        if r is None or r.alive:
            return None
        why = r.error or "the receiver thread ended"
        r.restart()
        return why

    def request_dump(self) -> Optional[int]:
        """Ask the ranks for their flight-recorder dumps: the next beacons carry a new request
        number, which each rank's supervisor watch answers once (clusterops.watchdog). None
        without a network channel (the file channel has no beacons)."""
        if self.receiver is None:
            return None
        self.receiver.dump += 1
        return self.receiver.dump

    @property
    def env_value(self) -> str:
        """What the ranks get as ``protocol.ENV_HEARTBEAT_ADDR``."""
        return self.addr

    def snapshot(self, expected_ranks: int) -> Beats:
        """rank -> (step, time of progress), from the network and, when needed, the files."""
        if self.mode == "rank-files":
            return self._scan()
        now = self.clock()
        beats: Beats = {}
        fresh = 0
        if self.receiver is not None:
            for r, (step, t, _, heard) in self.receiver.snapshot().items():
                beats[r] = (step, t)
                fresh += heard >= now - self.fallback_after_s
        if self.mode == "net" and fresh >= expected_ranks:
            return beats
        for r, beat in self._scan().items():
            if r not in beats or beat[1] > beats[r][1]:
                beats[r] = beat
        return beats

    def _scan(self) -> Beats:
        ranks, nodes = protocol.read_heartbeat_files(self.hb_dir)
        self.file_scans += 1
        self.files_read += len(ranks) + len(nodes)
        token = self.receiver.token if self.receiver is not None else hbc.addr_token(self.addr) or None
        for payload, mtime in nodes.values():
            try:
                d = hbc.decode(payload, token)
            except hbc.BadDatagram:
                continue
            for b in d.ranks:
                t = mtime - b.age_ms / 1000.0
                if b.rank not in ranks or t > ranks[b.rank][1]:
                    ranks[b.rank] = (b.step, t)
                    self.file_timing[b.rank] = (b.step, b.step_ms, b.busy_ms)
                    if b.loss is not None or b.grad_norm is not None:
                        self.file_signals[b.rank] = (b.step, b.loss, b.grad_norm)
        return ranks

    def signals(self) -> Dict[int, Tuple[int, Optional[float], Optional[float]]]:
        """rank -> (step, loss, grad norm) of its latest beat that carried them (network or
        node files, the newer step wins); for ``sv.Heartbeats.signals`` (the stability guard)."""
        out = dict(self.file_signals)
        if self.receiver is not None:
            with self.receiver.lock:
                net = dict(self.receiver.signals)
            for r, v in net.items():
                if r not in out or v[0] >= out[r][0]:
                    out[r] = v
        return out

    def timings(self) -> Dict[int, Tuple[int, int, int]]:
        """rank -> (step, step_ms, busy_ms) of its latest beat (-1: not known), from the
        network and from the node files last scanned (the newer step wins); for
        ``sv.Heartbeats.timing`` (straggler detection)."""
        out = dict(self.file_timing)
        if self.receiver is not None:
            for r, beat in self.receiver.timings().items():
                if r not in out or beat[0] >= out[r][0]:
                    out[r] = beat
        return out

    def step_times_ms(self) -> Dict[int, int]:
        """rank -> its latest mean step time (ms) heard over the network; for straggler work."""
        if self.receiver is None:
            return {}
        return {r: v[2] for r, v in self.receiver.snapshot().items() if v[2] >= 0}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
