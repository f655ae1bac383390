"""The node heartbeat channel: the ranks of a node report together, once per interval.

With one heartbeat file per rank on the job directory, 2,048 nodes x 8 ranks make ~16k
metadata operations a second in one directory of the parallel filesystem, and as many
reads on the batch host. This channel costs one small message per *node* and interval,
and none of it touches the shared filesystem:

1. Each rank writes its beat (step, time of progress, mean step and busy time) to a node-local
   file, ``<local root>/clusterops-hb-<key>/<node>/rank<R>`` (``/dev/shm`` when it is
   there, else the temporary directory): a rename in memory, nothing shared.
2. The first rank of the node to beat in an interval wins that interval (an exclusive
   create of ``slot-<k>`` in the same directory; each node's intervals start at its own
   phase, :func:`node_phase`, so that a job in lockstep spreads its sends over the second), reads its node's rank files and sends
   them as one datagram to the supervisor (UDP, ``protocol.ENV_HEARTBEAT_ADDR``). Any live
   rank of the node can send, so a stopped rank (SIGSTOP, a deadlock) is still reported
   -- with its old time -- by its neighbours, and named by rank and node.
3. When the datagram cannot be sent (no route, bad address) or the address is ``file``
   (``file/TOKEN``), the same bytes go to ``<heartbeat dir>/node-<node>`` on the job
   directory: one create and one rename per node and interval, the file fallback.

``<key>`` hashes the address (with its per-attempt token) and the heartbeat directory, so
no attempt reads another's beats, and nobody without the token can predict the path. The
node-local root is writable by every user of the node, so the directories are made 0700
and checked after creation (a directory, not a symlink, this user's, no group or other
bits: :func:`ensure_private_dir`), files are read with ``O_NOFOLLOW`` and written by
rename from an ``O_EXCL`` temporary (:func:`clusterops.protocol.write_private`, mode
0600); anything else there, or an address without a token, is :class:`ChannelRefused`
(the SDK then writes the rank's own heartbeat file). The node-local directories are left behind when a job
ends (a rank killed with kill -9 cannot clean up): each new sender removes this user's
``clusterops-hb-*`` directories that no rank has written to for :data:`STALE_AFTER_S`.

The datagram (version 1) is compact JSON, about 200 bytes for 8 ranks::

    {"v":1,"tok":"<token>","node":"n17","seq":42,"ranks":[[R,step,age_ms,step_ms],...],
     "busy":[busy_ms,...],"loss":[loss,...],"gnorm":[grad_norm,...]}

``age_ms`` is how long before the send the rank last made progress (so the receiver
needs no clock agreement: progress time = receive time - age), ``step_ms`` the rank's
mean step time over its last beat interval (-1 when not known yet, or when a checkpoint
save fell in the interval). ``busy`` (optional, one entry per ``ranks`` entry, same
order) is each rank's mean *busy* time per step over that interval: the time the script
spent in ``sdk.compute()`` blocks, i.e. not waiting in a collective (-1: not known). In a
synchronous job every rank's step takes as long as the slowest rank's, so only busy
time tells the slow rank apart (clusterops.supervisor.stragglers). A sender without
busy times leaves the key out; a receiver that does not know the key ignores it, so old
senders and old receivers keep working. ``loss`` and ``gnorm`` (optional the same way, for
the stability guard, clusterops.supervisor.stability) are each rank's mean loss and largest
grad norm over the interval, ``null`` when the rank does not report it, and the strings
``"nan"``, ``"inf"``, ``"-inf"`` for a value that is not finite (JSON has no NaN).
The token, given in the address (``HOST:PORT/TOKEN``), ties a datagram to one attempt
of one job: the receiver drops any other, before parsing it (:func:`decode` with the
token: size, token, then nesting, then ``json.loads``; it raises only BadDatagram).

The channel is two-way (still version 1): a datagram with ``"kind":"ping"`` (no rank
entries; sent once per node and interval by the ranks' supervisor watch,
:mod:`clusterops.watchdog`) is answered by the receiver, to the address it came from, with a
beacon ``{"v":1,"tok":"<token>","kind":"beacon","seq":N,"lost_ms":L}`` (:func:`encode_beacon`):
"I am alive; if you hear nothing from me for L ms, I am gone". A datagram without ``kind``
is a node's beats, as before; a receiver that predates pings takes a ping as an empty
report (no beacon comes back, and a rank that never heard a beacon never declares its
supervisor lost), and a sender that predates beacons never pings. Beacons carry the token
too: a rank takes none from anyone who does not hold it.

Standard library only: the SDK imports it from ``sdk.heartbeat`` and the supervisor's
receiver (:mod:`clusterops.supervisor.channel`) decodes with :func:`decode`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from clusterops import protocol

VERSION = 1
#: A datagram larger than this is not ours (8 ranks take ~200 bytes; 256 ranks ~7 KB).
MAX_DATAGRAM = protocol.MAX_DATAGRAM_BYTES
#: Nesting of a datagram: the object, its ``ranks`` list, a rank entry. Bytes nested deeper
#: are refused before the JSON parser sees them (a deeply nested array is a RecursionError
#: in ``json.loads``, not a ValueError).
MAX_DEPTH = 3
#: Longer node names are not a Slurm node's.
MAX_NODE_NAME = 256
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_PAIR = re.compile(rb"\[\]|\{\}")


class BadDatagram(ValueError):
    """Bytes that are not a heartbeat datagram of this version."""


class ChannelRefused(OSError):
    """The node channel will not run with this address or node-local directory: an address
    without a token (its node-local directory would be predictable), or a directory at the
    node-local path that is not this user's own private one (planted by someone else)."""


@dataclass(frozen=True)
class RankBeat:
    rank: int
    step: int
    age_ms: int           # progress this long before the send
    step_ms: int          # mean step time over the last beat interval; -1: not known
    busy_ms: int = -1     # mean busy (not waiting) time per step over that interval; -1: not known
    loss: Optional[float] = None       # mean loss over that interval (NaN/inf: one was not finite)
    grad_norm: Optional[float] = None  # largest grad norm over that interval


@dataclass(frozen=True)
class Datagram:
    token: str
    node: str
    seq: int
    ranks: Tuple[RankBeat, ...]
    kind: str = "beats"   # KIND_BEATS, or KIND_PING (the supervisor watch asking for a beacon)


KIND_BEATS, KIND_PING, KIND_BEACON = "beats", "ping", "beacon"
#: The bytes every ping :func:`encode` makes contains (the receiver's quick test).
PING_MARK = b'"kind":"ping"'


@dataclass(frozen=True)
class Beacon:
    """The supervisor's answer to a ping: alive; gone once silent for ``lost_ms``. ``dump``:
    the supervisor's latest request for the ranks' flight-recorder dumps (0: none), which
    a hang's stack capture raises (clusterops.supervisor.flightrec)."""
    seq: int
    lost_ms: int
    dump: int = 0


# ------------------------------------------------------------------------ codec


def encode(d: Datagram) -> bytes:
    body = {"v": VERSION, "tok": d.token, "node": d.node, "seq": int(d.seq),
            "ranks": [[int(b.rank), int(b.step), int(b.age_ms), int(b.step_ms)] for b in d.ranks]}
    if d.kind != KIND_BEATS:
        body["kind"] = d.kind
    if any(b.busy_ms >= 0 for b in d.ranks):
        body["busy"] = [int(b.busy_ms) for b in d.ranks]
    if any(b.loss is not None for b in d.ranks):
        body["loss"] = [_num_out(b.loss) for b in d.ranks]
    if any(b.grad_norm is not None for b in d.ranks):
        body["gnorm"] = [_num_out(b.grad_norm) for b in d.ranks]
    return json.dumps(body, separators=(",", ":")).encode()


#: How a value that is not finite travels (JSON has no NaN): as one of these strings.
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _num_out(x: Optional[float]):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else ("nan" if x != x else ("inf" if x > 0 else "-inf"))


def _num_list(body: dict, key: str, n: int) -> List[Optional[float]]:
    """The optional per-rank list ``key`` (numbers, null, or "nan"/"inf"/"-inf"); BadDatagram."""
    vals = body.get(key)
    if vals is None:
        return [None] * n
    if not isinstance(vals, list) or len(vals) != n:
        raise BadDatagram(f"{key} must be a list, one entry per rank entry")
    out: List[Optional[float]] = []
    for x in vals:
        if x is None:
            out.append(None)
        elif isinstance(x, str) and x in _NON_FINITE:
            out.append(_NON_FINITE[x])
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(float(x))
        else:
            raise BadDatagram(f"{key} entry {x!r} is not a number, null or nan/inf/-inf")
    return out


@functools.lru_cache(maxsize=8)
def token_mark(token: str) -> bytes:
    """The bytes every datagram :func:`encode` makes for ``token`` contains."""
    return b'"tok":' + json.dumps(token).encode()


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the brackets of ``data`` nest deeper than ``limit`` (exact for brackets that
    pair up; of brackets that do not, at most ``limit`` left open pass, which bounds what
    the parser would nest to twice ``limit``: it then rejects them itself).

    Brackets inside JSON strings count too: no string our encoder writes holds one (a token
    is hex, a Slurm node name has no brackets). At C speed: every byte but the brackets
    dropped, then ``limit`` passes that each take away the innermost pairs."""
    s = data.translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not s:
            return False
        s = _BRACKET_PAIR.sub(b"", s)
    return _BRACKET_PAIR.search(s) is not None or s.count(b"[") + s.count(b"{") > limit


def decode(data: bytes, token: Optional[str] = None) -> Datagram:
    """The datagram in ``data``; BadDatagram naming what is wrong.

    Checked before parsing: the size, the token (when ``token`` is given, bytes without
    :func:`token_mark` are not parsed at all) and the nesting (:data:`MAX_DEPTH`), so no
    bytes reach ``json.loads`` that could make it recurse deeply; whatever ``data`` holds,
    this raises nothing but BadDatagram."""
    if not isinstance(data, (bytes, bytearray)):
        raise BadDatagram(f"not bytes: {type(data).__name__}")
    if len(data) > MAX_DATAGRAM:
        raise BadDatagram(f"{len(data)} bytes, more than {MAX_DATAGRAM}")
    if token is not None and token_mark(token) not in data:
        raise BadDatagram("not this attempt's token")
    if too_deep(data):
        raise BadDatagram(f"nested deeper than {MAX_DEPTH}")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError, int digits: ValueError
        raise BadDatagram(f"not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadDatagram("not a JSON object")
    if body.get("v") != VERSION:
        raise BadDatagram(f"version {body.get('v')!r}, this receiver reads {VERSION}")
    tok, node, seq, ranks = body.get("tok"), body.get("node"), body.get("seq"), body.get("ranks")
    if not isinstance(tok, str) or not isinstance(node, str) or not node:
        raise BadDatagram("tok and node must be strings")
    if token is not None and tok != token:
        raise BadDatagram("not this attempt's token")
    if len(node) > MAX_NODE_NAME or "/" in node or "\0" in node:
        raise BadDatagram(f"node name {node[:40]!r}... is not a node's")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(ranks, list):
        raise BadDatagram("seq must be an integer and ranks a list")
    busy = body.get("busy")
    if busy is not None and (not isinstance(busy, list) or len(busy) != len(ranks) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in busy)):
        raise BadDatagram("busy must be a list of integers, one per rank entry")
    losses, gnorms = _num_list(body, "loss", len(ranks)), _num_list(body, "gnorm", len(ranks))
    beats = []
    for i, item in enumerate(ranks):
        if (not isinstance(item, list) or len(item) != 4
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            raise BadDatagram(f"rank entry {item!r} is not [rank, step, age_ms, step_ms]")
        r, step, age, sms = item
        if r < 0 or age < 0:
            raise BadDatagram(f"rank entry {item!r}: negative rank or age")
        beats.append(RankBeat(r, step, age, sms, busy[i] if busy is not None else -1, losses[i], gnorms[i]))
    kind = body.get("kind", KIND_BEATS)
    if kind not in (KIND_BEATS, KIND_PING):
        raise BadDatagram(f"kind {str(kind)[:20]!r} is not a rank's datagram")
    return Datagram(tok, node, seq, tuple(beats), kind)


def encode_beacon(token: str, seq: int, lost_ms: int, dump: int = 0) -> bytes:
    body = {"v": VERSION, "tok": token, "kind": KIND_BEACON, "seq": int(seq), "lost_ms": int(lost_ms)}
    if dump:
        body["dump"] = int(dump)      # optional: an older watch ignores it
    return json.dumps(body, separators=(",", ":")).encode()


def decode_beacon(data: bytes, token: str) -> Beacon:
    """The beacon in ``data`` for this attempt's ``token``; BadDatagram otherwise (checked
    as :func:`decode` checks: size and token before the parser)."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > 1024:
        raise BadDatagram("not a beacon: too big")
    if token_mark(token) not in data or too_deep(data, 1):
        raise BadDatagram("not this attempt's beacon")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise BadDatagram(f"not JSON: {e}") from None
    if (not isinstance(body, dict) or body.get("v") != VERSION or body.get("tok") != token
            or body.get("kind") != KIND_BEACON):
        raise BadDatagram("not this attempt's beacon")
    seq, lost = body.get("seq"), body.get("lost_ms")
    dump = body.get("dump", 0)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (seq, lost, dump)) or lost <= 0 or dump < 0:
        raise BadDatagram("beacon seq, lost_ms and dump must be integers, lost_ms > 0, dump >= 0")
    return Beacon(seq, lost, dump)


def _num_in(text: str) -> Optional[float]:
    """A field of a node-local rank file written by :meth:`NodeSender.beat`: "None" or a float."""
    return None if text == "None" else float(text)


def parse_addr(addr: str) -> Tuple[str, int, str]:
    """``HOST:PORT/TOKEN`` -> (host, port, token); ValueError when it is not that."""
    hostport, sep, token = addr.partition("/")
    host, sep2, port = hostport.rpartition(":")
    if not sep or not sep2 or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"heartbeat address {addr!r} is not HOST:PORT/TOKEN")
    return host.strip("[]"), int(port), token


# ------------------------------------------------------------------------ sender


#: A node-local beat directory untouched this long belongs to no running job.
STALE_AFTER_S = 3600.0
LOCAL_PREFIX = "clusterops-hb-"


def remove_stale(root: str, now: float, keep: str = "") -> int:
    """Remove this user's node-local beat directories under ``root`` that no rank has
    written to for :data:`STALE_AFTER_S` (their node directories' times: every beat renames
    a file in one); ``keep`` is never removed. Returns how many were removed."""
    removed = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    uid = os.getuid()
    for e in entries:
        if not e.name.startswith(LOCAL_PREFIX) or e.path == keep:
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != uid:
                continue
            newest = e.stat(follow_symlinks=False).st_mtime
            for sub in os.scandir(e.path):
                newest = max(newest, sub.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
        if now - newest > STALE_AFTER_S:
            shutil.rmtree(e.path, ignore_errors=True)
            removed += 1
    return removed


PRIVATE_DIR_MODE = 0o700


def ensure_private_dir(path: str) -> None:
    """Create directory ``path`` (mode 0700) or take the one there, but only when it is safe:
    a directory (not a symlink: checked with ``lstat``), owned by this user, closed to group
    and others. ChannelRefused otherwise: another user may have planted it (the node-local
    root, ``/dev/shm`` or the temporary directory, is writable by everyone)."""
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ChannelRefused(f"{path}: not a directory (a link or file is in its place)")
    if st.st_uid != os.getuid():
        raise ChannelRefused(f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise ChannelRefused(f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, open to other users")


def make_local_dir(local: str) -> None:
    """Create the node-local beat directory ``<root>/clusterops-hb-<key>/<node>`` and its key
    directory, each checked by :func:`ensure_private_dir` (the root is only created when it
    is missing: a custom root; ``/dev/shm`` is there)."""
    key_dir = os.path.dirname(local)
    root = os.path.dirname(key_dir)
    if not os.path.isdir(root):
        os.makedirs(root, mode=PRIVATE_DIR_MODE, exist_ok=True)
    ensure_private_dir(key_dir)
    ensure_private_dir(local)


def addr_token(addr: str) -> str:
    """The token of a heartbeat address (``HOST:PORT/TOKEN`` or ``file/TOKEN``); "" when none."""
    return addr.partition("/")[2] if "/" in addr else ""


def local_root() -> str:
    """Node-local memory when there is some (``/dev/shm``), else the temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def local_dir(addr: str, hb_dir: str, node: str, root: Optional[str] = None) -> str:
    """The node-local directory where the ranks of ``node`` leave their beats for an attempt."""
    key = hashlib.sha1(f"{addr}\0{hb_dir}".encode()).hexdigest()[:12]
    return os.path.join(root or local_root(), f"{LOCAL_PREFIX}{key}", node)


def read_local_steps(addr: str, hb_dir: str, root: Optional[str] = None) -> Dict[int, int]:
    """rank -> step of every node's local beats on this machine (one host, all nodes: the
    dev cluster), for watching a run from outside it."""
    base = os.path.dirname(local_dir(addr, hb_dir, "x", root))
    steps: Dict[int, int] = {}
    try:
        nodes = os.listdir(base)
    except OSError:
        return steps
    for node in nodes:
        try:
            names = os.listdir(os.path.join(base, node))
        except OSError:
            continue
        for name in names:
            if name.startswith("rank") and name[4:].isdigit():
                try:
                    steps[int(name[4:])] = int(_read_small(os.path.join(base, node, name)).split()[0])
                except (OSError, ValueError, IndexError):
                    continue
    return steps


def _read_small(path: str, limit: int = 256) -> str:
    """The start of a small file, never through a symlink (``O_NOFOLLOW``); OSError/ValueError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return os.read(fd, limit).decode("ascii")
    finally:
        os.close(fd)


def node_phase(node: str, interval_s: float = 1.0) -> float:
    """Where in the interval a node's slots begin: spread by the node's name, so that the
    nodes of a job in lockstep do not all send in the same millisecond (a burst of 2,048
    datagrams overflows a receive buffer)."""
    return (zlib.crc32(node.encode()) % 1000) / 1000.0 * interval_s


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class NodeSender:
    """One rank's end of the node channel (see the module docstring)."""

    def __init__(self, addr: str, hb_dir: str, rank: int, *, node: Optional[str] = None,
                 root: Optional[str] = None, interval_s: float = 1.0, clock=time.time):
        self.addr, self.hb_dir, self.rank = addr, str(hb_dir), int(rank)
        self.node = node or node_name()
        self.interval_s = interval_s
        self.clock = clock
        # The token keys the node-local directory: without one its path is predictable, and
        # anyone on the node could plant a directory there first. Refused, not served.
        self.token = addr_token(addr)
        if not self.token:
            raise ChannelRefused(f"heartbeat address {addr!r} has no token: the node channel needs one")
        self.local = local_dir(addr, self.hb_dir, self.node, root)
        make_local_dir(self.local)
        remove_stale(os.path.dirname(os.path.dirname(self.local)), clock(),
                     keep=os.path.dirname(self.local))
        self.dest: Optional[Tuple[str, int]] = None
        self.sock: Optional[socket.socket] = None
        if not protocol.is_file_addr(addr):
            try:
                host, port, _ = parse_addr(addr)
                info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
                self.sock = socket.socket(info[0], socket.SOCK_DGRAM)
                self.dest = info[4]
            except (OSError, ValueError):
                self.sock = None        # the file fallback, every interval
        self.phase_s = node_phase(self.node, interval_s)
        self.last: Optional[Tuple[int, float]] = None   # (step, time) of the previous beat
        self.seq = 0
        self.sent = 0                   # datagrams sent by this rank
        self.file_writes = 0            # node files written on the shared filesystem

    # -- the rank's beat -------------------------------------------------------------
    def beat(self, step: int, *, busy_s: Optional[float] = None, paused: bool = False,
             loss: Optional[float] = None, grad_norm: Optional[float] = None) -> bool:
        """Record this rank's progress; send the node's datagram when this rank wins the
        interval. Returns True when this rank sent (or wrote the node file).

        ``busy_s``: seconds this rank was busy (not waiting) since its previous beat, None
        when the script does not say; ``paused``: a checkpoint save fell in that time, so
        neither figure is a step time (both go out as -1); ``loss``/``grad_norm``: the
        training signals of the interval (the stability guard), None when not reported."""
        now = self.clock()
        step_ms = busy_ms = -1
        if self.last is not None and step > self.last[0] and not paused:
            step_ms = round(1000 * (now - self.last[1]) / (step - self.last[0]))
            if busy_s is not None:
                busy_ms = max(0, round(1000 * busy_s / (step - self.last[0])))
        self.last = (step, now)
        final = os.path.join(self.local, f"rank{self.rank}")
        line = f"{int(step)} {now!r} {step_ms} {busy_ms}".encode()
        if loss is not None or grad_norm is not None:   # fields 5 and 6 (the stability guard)
            line += f" {_num_out(loss)} {_num_out(grad_norm)}".encode()
        line += b"\n"
        try:
            protocol.write_private(final, line)
        except FileNotFoundError:       # removed while the job was suspended for hours
            make_local_dir(self.local)
            protocol.write_private(final, line)
        slot = int((now - self.phase_s) // self.interval_s)
        try:
            os.close(os.open(os.path.join(self.local, f"slot-{slot}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             protocol.PRIVATE_FILE_MODE))
        except FileExistsError:
            return False                # a neighbour sends this interval
        for old in (slot - 2, slot - 3):
            try:
                os.unlink(os.path.join(self.local, f"slot-{old}"))
            except OSError:
                pass
        self.send(now)
        return True

    def collect(self, now: float) -> List[RankBeat]:
        """The node's rank files as beats, ages relative to ``now``."""
        beats = []
        for name in os.listdir(self.local):
            if not name.startswith("rank") or not name[4:].isdigit():
                continue
            try:
                fields = _read_small(os.path.join(self.local, name)).split()
                step, t, sms = fields[:3]            # a fourth field (busy) since busy times
                busy = int(fields[3]) if len(fields) > 3 else -1
                loss, gnorm = (_num_in(fields[4]), _num_in(fields[5])) if len(fields) > 5 else (None, None)
                beats.append(RankBeat(int(name[4:]), int(step), max(0, round(1000 * (now - float(t)))), int(sms),
                                      busy, loss, gnorm))
            except (OSError, ValueError):
                continue            # torn or foreign: the next interval reads it
        beats.sort(key=lambda b: b.rank)
        return beats

    def send(self, now: float) -> None:
        self.seq += 1
        self.transmit(encode(Datagram(self.token, self.node, self.seq, tuple(self.collect(now)))))

    def transmit(self, payload: bytes) -> None:
        """Send one datagram to the supervisor; on failure (or in ``file`` mode) write it as
        the node's file in the heartbeat directory. OSError when even that fails."""
        if self.sock is not None:
            try:
                self.sock.sendto(payload, self.dest)
                self.sent += 1
                return
            except OSError:
                pass                    # no route to the supervisor: the file fallback
        protocol.write_node_heartbeat(self.hb_dir, self.node, payload)
        self.file_writes += 1
