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

The channel mode is a setting of the supervisor (``CLUSTEROPS_SUPERVISE_HEARTBEAT``):
``net`` (default), ``file`` (the per-node files only: the forced fallback), ``rank-files``
(the old channel: one file per rank, read every poll).
"""

from __future__ import annotations

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


def mode_from_env(environ=os.environ) -> str:
    mode = (environ.get(MODE_ENV) or "net").strip()
    if mode not in MODES:
        raise InputError(f"{MODE_ENV}={mode!r}: must be one of {', '.join(MODES)}")
    return mode


class Receiver:
    """A thread that takes heartbeat datagrams on a UDP socket and keeps, per rank, the
    latest (step, time of progress, step_ms, time received) and its busy_ms, and per node the time heard."""

    def __init__(self, token: str, *, bind_host: str = "", clock: Callable[[], float] = time.time):
        self.token = token
        self.clock = clock
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:    # room for a second of datagrams from thousands of nodes (the kernel may cap it)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        except OSError:
            pass
        self.sock.bind((bind_host, 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.ranks: Dict[int, Tuple[int, float, int, float]] = {}
        self.busy: Dict[int, int] = {}     # rank -> busy_ms of the beat in ranks (-1: not known)
        self.nodes: Dict[str, float] = {}
        self.received = 0
        self.dropped = 0          # undecodable, another version, another token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="clusterops-heartbeats", daemon=True)

    def start(self) -> "Receiver":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.sock.close()

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
                    data = self.sock.recv(hbc.MAX_DATAGRAM + 1)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return
                self.feed(data, now)
            self._stop.wait(DRAIN_S)

    def feed(self, data: bytes, now: float) -> bool:
        """Take one datagram received at ``now``; False when it is dropped."""
        try:
            d = hbc.decode(data)
        except hbc.BadDatagram:
            self.dropped += 1
            return False
        if d.token != self.token:
            self.dropped += 1
            return False
        with self.lock:
            self.received += 1
            self.nodes[d.node] = now
            for b in d.ranks:
                t = now - b.age_ms / 1000.0
                old = self.ranks.get(b.rank)
                if old is None or t >= old[1]:
                    self.ranks[b.rank] = (b.step, t, b.step_ms, now)
                    self.busy[b.rank] = b.busy_ms
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


class Channel:
    """One attempt's heartbeat channel, supervisor side."""

    def __init__(self, mode: str, hb_dir: os.PathLike, *, advertise_host: str = "127.0.0.1",
                 fallback_after_s: float = 3.0, clock: Callable[[], float] = time.time):
        if mode not in MODES:
            raise InputError(f"heartbeat channel {mode!r}: must be one of {', '.join(MODES)}")
        self.mode = mode
        self.hb_dir = hb_dir
        self.fallback_after_s = fallback_after_s
        self.clock = clock
        self.receiver: Optional[Receiver] = None
        self.addr = ""
        if mode == "net":
            token = secrets.token_hex(8)
            self.receiver = Receiver(token, clock=clock).start()
            self.addr = f"{advertise_host}:{self.receiver.port}/{token}"
        elif mode == "file":
            self.addr = f"{protocol.HEARTBEAT_ADDR_FILE}/{secrets.token_hex(8)}"
        self.file_scans = 0           # times the heartbeat directory was read
        self.files_read = 0           # files read in those scans
        self.file_timing: Dict[int, Tuple[int, int, int]] = {}   # rank -> (step, step_ms, busy_ms), files

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
        for payload, mtime in nodes.values():
            try:
                d = hbc.decode(payload)
            except hbc.BadDatagram:
                continue
            if self.receiver is not None and d.token != self.receiver.token:
                continue
            for b in d.ranks:
                t = mtime - b.age_ms / 1000.0
                if b.rank not in ranks or t > ranks[b.rank][1]:
                    ranks[b.rank] = (b.step, t)
                    self.file_timing[b.rank] = (b.step, b.step_ms, b.busy_ms)
        return ranks

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
