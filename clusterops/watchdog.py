"""The ranks' watch on their supervisor: the job goes on when the batch host is lost.

The supervisor runs in the batch script, on the job's first node. When that node is lost
as a power cut loses it (its slurmd, slurmstepds and every process at once), Slurm,
honouring ``--no-kill``, drops the node and keeps the job RUNNING on the survivors, with no
batch script: nothing in Slurm requeues it, and the allocation sits idle until its time
limit. So the ranks watch their supervisor through the heartbeat channel, which is
two-way (:mod:`clusterops.heartbeat`: a ``ping`` per node and interval, answered with a
``beacon`` by the supervisor's receiving thread, :mod:`clusterops.supervisor.channel`):

1. **Listening.** One :class:`Watchdog` thread per rank, started with the rank's node
   sender (``sdk.heartbeat``). Once per interval, the first rank of the node to claim the
   interval (an exclusive create of ``ping-<k>`` in the node-local directory, as the beats
   do) pings from its own socket; the beacon it gets back is written to the node-local
   ``beacon`` file, which every rank of the node reads. One datagram each way per node and
   interval, nothing on the shared filesystem.
2. **Silence is a question, Slurm answers it.** The beacon says how long a silence means
   "maybe gone" (``lost_ms``). A rank that never heard a beacon (an older supervisor) never
   asks. A silence that long -- whether or not this rank still makes progress: a network
   pause stalls the collectives too -- only makes the node ask Slurm whether the batch host
   is gone: the job's batch host no longer in the job (Slurm dropped it, and the batch
   script with it) or that node :data:`GONE_STATES` / :data:`GONE_FLAGS` (``DOWN``,
   ``NOT_RESPONDING``, powered down). A read that fails or times out is no answer, never
   "gone". One rank per node asks per :data:`CONFIRM_EVERY_S` (an exclusive create of
   ``ask-<k>`` in the node's private node-local directory, 0700 like the beats'); its answer
   goes to the node-local ``slurm-word`` file (0600), which the node's other ranks read, so
   slurmctld sees two reads (``scontrol show job``, ``show node``) per node and interval, not
   per rank. When Slurm says gone, a rank still making progress is asked to stop
   (``sdk.should_stop()`` true, reason ``supervisor_lost``) so the ranks save through the
   SDK's atomic commit and leave, and requeues at its exit; a rank that made no progress
   for the silence (its peers on the lost node are gone, so its collectives hang) takes
   over from the thread at once: Slurm ends the step when it marks the batch host down,
   and such a rank may never reach its exit.
3. **At exit** (``atexit``, so also when the script dies of a failed collective), a rank
   with a watch first looks whether the supervisor relaunched the training in the
   allocation (the job directory has the next ``attempt-<N+1>``: the supervisor makes it
   before it closes this attempt's channel); then the exit is no fault and the watch does
   nothing at all. Otherwise it pings once more and waits for the answer, at most until the
   silence reaches ``lost_ms``: a live supervisor answers within milliseconds, so an
   ordinary fault costs no time. No answer is again only a question for Slurm (as in 2,
   for as long as Slurm takes to see a node go: SlurmdTimeout and two intervals, between
   :data:`EXIT_CONFIRM_S` and :data:`EXIT_CONFIRM_MAX_S`, ended early by a relaunch); without
   Slurm's "gone" the rank leaves without acting.
4. **One requeue, retried.** The ranks that Slurm told the batch host is gone elect one:
   each waits ``STAGGER_S`` per rank below it (capped at :data:`MAX_STAGGER`), then
   claims the attempt's ``takeover`` marker on the shared job directory by an exclusive
   create; the first wins (normally the lowest surviving rank, but the nodes heard their
   last beacons up to an interval apart and a loaded node is late, so only "exactly one" is
   sure). The marker says where the takeover stands (:class:`Takeover`): ``claimed`` and
   ``retrying`` carry a lease (``until``) that the owner renews before every try; ``asked``
   (requeued) and ``not_needed`` (the job is no longer this incarnation running) end it;
   ``released`` (the owner's tries ran out) or a lease that passed let another rank claim
   the next generation (an exclusive create of ``takeover.<g>``, at most
   :data:`MAX_CLAIMS`). A rank that sees a live claim waits and looks again; only ``asked``
   and ``not_needed`` make it stop. Each try of the owner reads the job and its batch host
   again: the job must still run this incarnation and Slurm must still say the host is gone
   (a host Slurm says is back releases the claim). It records ``supervisor_lost`` (once)
   and ``takeover`` in the job's timeline and requeues the job
   (:meth:`clusterops.slurm.api.SlurmAPI.requeue`); a failed try (a read that timed out, a
   requeue refused) is recorded and retried after ``Backoff`` pauses
   (:data:`TAKEOVER_TRIES` tries). Slurm ends the job's processes, holds the job until the
   lost node is marked down, and starts the next incarnation on healthy nodes, which
   resumes from the latest good checkpoint.

Settings: the silence (``CLUSTEROPS_SUPERVISOR_LOST_S``) is the supervisor's
(:mod:`clusterops.supervisor.channel`), sent in every beacon.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import select
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

from clusterops import heartbeat as hbc
from clusterops import protocol

log = logging.getLogger("clusterops.watchdog")

BEACON_FILE = "beacon"
PING_PREFIX = "ping-"
#: Node-local: the rank that asks Slurm in a confirmation interval, and the node's answer.
ASK_PREFIX = "ask-"
EXIT_ASK_PREFIX = "ask-exit-"       # at exit: a word newer than the exit is wanted
WORD_FILE = "slurm-word"
TAKEOVER_FILE = "takeover"
#: How often one rank of a node asks Slurm about a silent supervisor.
CONFIRM_EVERY_S = 5.0
#: At exit, how long a rank waits for Slurm's word (two confirmation intervals: a read that
#: failed is asked again once).
EXIT_CONFIRM_S = 2 * CONFIRM_EVERY_S + 1.0
#: ... and at most this long, however long Slurm takes to see a node go (SlurmdTimeout).
EXIT_CONFIRM_MAX_S = 660.0
#: At exit, how long a rank waits for another rank's takeover to settle (it claims the next
#: generation itself when that one is released or its lease passes in this time).
EXIT_TAKEOVER_S = 30.0
#: How often a rank looks at another rank's claim (the shared job directory).
MARKER_POLL_S = 1.0
#: The election: a rank waits this long per rank below it before claiming the takeover.
STAGGER_S = 1.0
MAX_STAGGER = 4
#: The owner's tries, and the first pause between them (doubling, at most 8 s).
TAKEOVER_TRIES = 5
TAKEOVER_BACKOFF_S = 1.0
#: A claim's lease: longer than one try can take with the watch's Slurm client (two reads
#: of at most 2 x 10 s and a requeue of 10 s), so a live owner is never taken for a dead one.
LEASE_S = 60.0
#: Generations of claims before the ranks give up (each owner made its tries).
MAX_CLAIMS = 3
#: Stop reason given to the script when the supervisor is found gone.
STOP_REASON = "supervisor_lost"
#: What Slurm says of a batch host that is gone: its base state, or a flag.
GONE_STATES = frozenset({"down"})
GONE_FLAGS = frozenset({"NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN"})

#: Slurm's word on the batch host: gone, not gone, no answer (the read failed).
GONE, FINE, UNKNOWN = "gone", "fine", "unknown"


class Takeover(str, enum.Enum):
    """Where the attempt's takeover stands (the ``state`` of its marker)."""
    CLAIMED = "claimed"          # an owner holds it (lease ``until``) and tries
    RETRYING = "retrying"        # a try failed; the owner tries again (lease ``until``)
    ASKED = "asked"              # the requeue was asked: done
    NOT_NEEDED = "not_needed"    # the job no longer runs this incarnation: nothing to do
    RELEASED = "released"        # the owner's tries ran out (or Slurm says the host is back)


LIVE = (Takeover.CLAIMED.value, Takeover.RETRYING.value)
SETTLED = (Takeover.ASKED.value, Takeover.NOT_NEEDED.value)


def _slurm():
    from clusterops.slurm.factory import connect

    # Short, few tries: the watch schedules its own retries (one per confirmation interval,
    # the takeover's backoff), and a claim's lease must outlast one try.
    return connect(timeout_s=10.0, read_attempts=2)


def host_verdict(job, node) -> str:
    """Why Slurm's job record and batch-host node record say the batch host is gone; ""
    when they do not. ``node`` may be None (not read: the host is no longer in the job)."""
    host = getattr(job, "batch_host", None)
    if not host:
        return ""
    names = getattr(job, "node_names", ()) or ()
    if names and host not in names:
        return f"the batch host {host} is no longer in the job"
    if node is None:
        return ""
    flags = sorted(set(node.flags) & GONE_FLAGS)
    if node.state in GONE_STATES or flags:
        return f"the batch host {host} is {'+'.join([node.state, *flags])}"
    return ""


def marker_says(doc: Optional[dict], now: float) -> str:
    """What a rank does on reading the takeover marker ``doc`` (None: there is none):
    "claim" (none, released, or a lease that passed), "wait" (a live claim) or "done"."""
    if doc is None:
        return "claim"
    state = doc.get("state")
    if state in SETTLED:
        return "done"
    until = doc.get("until")
    if state in LIVE and isinstance(until, (int, float)) and now <= until:
        return "wait"
    return "claim"


def _create_excl(path: Path, data: bytes = b"") -> bool:
    """Create ``path`` exclusively (0600, never through a link); False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     protocol.PRIVATE_FILE_MODE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def read_marker(marker: Path) -> Optional[dict]:
    """The takeover marker's document; None when there is none. A marker just created and
    not yet written reads as a fresh claim of generation 0 (its lease from its mtime)."""
    try:
        text = hbc._read_small(str(marker), 4096)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        text = ""
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and "state" in doc:
            return doc
    except ValueError:
        pass
    try:
        mtime = os.lstat(marker).st_mtime
    except OSError:
        return None
    return {"state": Takeover.CLAIMED.value, "gen": 0, "until": mtime + LEASE_S}


class Watchdog:
    """One rank's watch on its supervisor (see the module docstring)."""

    def __init__(self, sender: hbc.NodeSender, *, rank: int, job_id: Optional[str] = None,
                 incarnation: Optional[int] = None, on_lost: Optional[Callable[[str], None]] = None,
                 slurm_factory: Callable[[], object] = _slurm, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, start: bool = True,
                 on_dump: Optional[Callable[[int], None]] = None):
        self.sender = sender
        # The supervisor's flight-recorder dump requests (a hang's stack capture): the newest
        # number heard on this node, and the newest this rank answered (on_dump, once each).
        self.on_dump = on_dump
        self._slurmd_timeout: Optional[float] = None
        self.dump_heard = 0
        self.dump_done = 0
        self.rank = int(rank)
        self.job_id = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID", "")
        # How Slurm's commands name the job (a chain's last task holds the array's own id).
        if job_id is None:
            from clusterops.slurm.api import own_job_ref

            job_id = own_job_ref()
        self.slurm_job = job_id
        self.incarnation = (int(os.environ.get("SLURM_RESTART_COUNT") or 0)
                            if incarnation is None else int(incarnation))
        self.on_lost = on_lost
        self.slurm_factory = slurm_factory
        self.clock = clock
        self.sleep = sleep
        self.heard_at: Optional[float] = None    # this rank's last beacon (clock time)
        self.lost_s: Optional[float] = None      # from the last beacon heard
        self.seq = 0
        self.pings = 0
        self.confirmed = False                   # Slurm said the batch host is gone
        self.gone_why = ""                       # ... and why
        self.asks = 0                            # Slurm asked by this rank (for the node)
        # None: not settled (not tried, or another rank's claim is pending); True: this rank
        # requeued; False: settled otherwise (another asked, not needed, or cannot be done).
        self.took_over: Optional[bool] = None
        self.retired = False                     # the attempt's channel closed by a relaunch
        self._staggered = False
        self._marker_next = -1e18
        self._lock = threading.Lock()            # one takeover at a time: thread or exit
        self._ping_now = threading.Event()
        self._stop = threading.Event()
        self.sock: Optional[socket.socket] = None
        if sender.dest is not None:
            self.sock = socket.socket(sender.sock.family if sender.sock else socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.setblocking(False)
        self.thread = threading.Thread(target=self._run, name="clusterops-watchdog", daemon=True)
        if start and self.sock is not None:
            self.thread.start()

    # -- what the rank heard ---------------------------------------------------------
    @property
    def beacon_path(self) -> str:
        return os.path.join(self.sender.local, BEACON_FILE)

    @property
    def attempt(self) -> Path:
        return Path(self.sender.hb_dir).parent

    def heard(self) -> Optional[float]:
        """When a beacon last reached this node (this rank or a neighbour); None: never."""
        best = self.heard_at
        try:
            fields = hbc._read_small(self.beacon_path).split()
            t, lost_ms = float(fields[0]), int(fields[1])
            if len(fields) > 2:
                self.dump_heard = max(self.dump_heard, int(fields[2]))
            if best is None or t > best:
                best = t
                if self.lost_s is None:
                    self.lost_s = lost_ms / 1000.0
        except (OSError, ValueError, IndexError):
            pass
        return best

    def silent_for(self, now: float) -> Optional[float]:
        heard = self.heard()
        return None if heard is None else max(0.0, now - heard)

    def stalled(self, now: float) -> bool:
        """This rank made no progress (no beat) for the supervisor's silence time."""
        last = self.sender.last
        return last is None or now - last[1] >= (self.lost_s or 0.0)

    def relaunched(self) -> bool:
        """Whether the supervisor started the next attempt (it makes ``attempt-<N+1>``
        before it closes this attempt's channel): this attempt's silence is no fault."""
        n = protocol.attempt_number(self.attempt)
        return n is not None and protocol.attempt_dir(self.attempt.parent, n + 1).is_dir()

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the watch must never end the training
                log.warning("supervisor watch of rank %d: %s", self.rank, e)
                self._stop.wait(1.0)

    def tick(self) -> None:
        now = self.clock()
        self._maybe_ping(now)
        self._receive(self.sender.interval_s / 2)
        self._maybe_dump()
        now = self.clock()
        if self.retired or self.took_over is not None:
            return
        silent = self.silent_for(now)
        if silent is None or self.lost_s is None or silent < self.lost_s:
            return
        if not self.confirmed:
            if self.relaunched():
                self.retired = True
                return
            verdict, why = self.confirm(now)
            if verdict != GONE:
                return
            self.confirmed, self.gone_why = True, why
            if self.on_lost is not None:
                self.on_lost(STOP_REASON)
        if self.stalled(now) and now >= self._marker_next:
            # Hung in a collective with the lost node's ranks: this rank may never exit.
            self._marker_next = now + MARKER_POLL_S
            self.take_over(self.gone_why)

    def _maybe_dump(self) -> None:
        """Answer the supervisor's newest dump request once (its beacon, or a neighbour's
        note of it in the node's beacon file). The callback runs on this thread: the rank's
        main thread may be blocked in the collective that hangs."""
        if self.on_dump is None:
            return
        self.heard()
        if self.dump_heard > self.dump_done:
            self.dump_done = self.dump_heard
            try:
                self.on_dump(self.dump_done)
            except Exception as e:  # noqa: BLE001 - a dump must never end the training
                log.warning("flight-recorder dump of rank %d: %s", self.rank, e)

    def _maybe_ping(self, now: float) -> None:
        slot = int((now - self.sender.phase_s) // self.sender.interval_s)
        if not self._ping_now.is_set():
            if not self._claim_slot(PING_PREFIX, slot):
                return              # a neighbour pings this interval
        self._ping_now.clear()
        self.ping()

    def _claim_slot(self, prefix: str, slot: int) -> bool:
        """Whether this rank won interval ``slot`` of its node (node-local, exclusive create)."""
        try:
            if not _create_excl(Path(self.sender.local) / f"{prefix}{slot}"):
                return False
        except OSError:
            return False
        for old in (slot - 2, slot - 3):
            try:
                os.unlink(os.path.join(self.sender.local, f"{prefix}{old}"))
            except OSError:
                pass
        return True

    def ping(self) -> None:
        self.seq += 1
        data = hbc.encode(hbc.Datagram(self.sender.token, self.sender.node, self.seq, (), hbc.KIND_PING))
        try:
            self.sock.sendto(data, self.sender.dest)
            self.pings += 1
        except OSError:
            pass                    # no route: the silence says it

    def _receive(self, timeout_s: float) -> None:
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout_s)
        except (OSError, ValueError):
            return
        if not ready:
            return
        while True:
            try:
                data = self.sock.recv(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:         # ECONNREFUSED: nobody listens on the port (any more)
                return
            try:
                b = hbc.decode_beacon(data, self.sender.token)
            except hbc.BadDatagram:
                continue
            now = self.clock()
            self.heard_at, self.lost_s = now, b.lost_ms / 1000.0
            self.dump_heard = max(self.dump_heard, b.dump)
            try:
                protocol.write_private(self.beacon_path, f"{now!r} {b.lost_ms} {b.dump}\n".encode())
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2.0)
        if self.sock is not None:
            self.sock.close()

    # -- Slurm's word -----------------------------------------------------------------
    @property
    def word_path(self) -> str:
        return os.path.join(self.sender.local, WORD_FILE)

    def _read_word(self) -> Optional[Tuple[float, str, str]]:
        try:
            doc = json.loads(hbc._read_small(self.word_path, 1024))
            return float(doc["t"]), str(doc["verdict"]), str(doc.get("why", ""))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def confirm(self, now: float, *, since: Optional[float] = None, prefix: str = ASK_PREFIX) -> Tuple[str, str]:
        """Slurm's word on the batch host for this confirmation interval, asked by one rank
        of the node: (GONE, why), (FINE, ""), or (UNKNOWN, why) when the read failed or
        another rank of the node is still asking. ``since``: only a word read after then
        counts (at exit: the node's word from before the exit may predate the loss)."""
        slot = int(now // CONFIRM_EVERY_S)
        word = self._read_word()
        if word is not None and word[0] >= slot * CONFIRM_EVERY_S and (since is None or word[0] >= since):
            return word[1], word[2]
        if not self._claim_slot(prefix, slot):
            return UNKNOWN, "another rank of the node asks Slurm"
        self.asks += 1
        verdict, why = self.ask_slurm()
        try:
            protocol.write_private(self.word_path, json.dumps(
                {"t": self.clock(), "verdict": verdict, "why": why[:300]}).encode())
        except OSError:
            pass                    # the node's other ranks ask in a later interval
        return verdict, why

    def _slurmd_timeout_s(self) -> float:
        """Slurm's SlurmdTimeout (how long it takes to see a node go), read once; 300 s (Slurm's
        default) when it cannot be read."""
        if self._slurmd_timeout is None:
            self._slurmd_timeout = 300.0
            try:
                m = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", self.slurm_factory().show_config(), re.MULTILINE)
                if m:
                    self._slurmd_timeout = float(m.group(1))
            except Exception as e:  # noqa: BLE001 - the default then
                log.warning("supervisor watch: SlurmdTimeout not read (%s): %g s assumed", e, self._slurmd_timeout)
        return self._slurmd_timeout

    def ask_slurm(self) -> Tuple[str, str]:
        """Slurm's word on the job's batch host, read now (two reads, no cache)."""
        if not self.job_id:
            return UNKNOWN, "no job id"
        try:
            slurm = self.slurm_factory()
            why = self._read_gone(slurm)[1]
        except Exception as e:  # noqa: BLE001 - no answer is no confirmation
            log.warning("supervisor watch: Slurm did not answer: %s", e)
            return UNKNOWN, f"{type(e).__name__}: {e}"
        return (GONE, why) if why else (FINE, "")

    def _read_gone(self, slurm):
        """(the job record, why Slurm says its batch host is gone or ""); raises when a read fails."""
        job = slurm.job(self.slurm_job)
        host = job.batch_host
        node = None
        if host and (not job.node_names or host in job.node_names):
            node = slurm.node(host)
        return job, host_verdict(job, node)

    def batch_host_gone(self) -> str:
        """Why Slurm says the job's batch host is gone ("" when it does not, or cannot say)."""
        verdict, why = self.ask_slurm()
        return why if verdict == GONE else ""

    # -- at exit -----------------------------------------------------------------------
    def at_exit(self) -> None:
        """Before the process ends: is the supervisor still there? Take over only when Slurm
        says its batch host is gone; never when the supervisor relaunched the training."""
        try:
            if self.sock is None or self.took_over is not None or self.retired:
                return
            if self.heard() is None:
                return              # never heard a beacon: an older supervisor, or none
            if not self.confirmed:
                if self.relaunched() or self._answered_at_exit() or self.relaunched():
                    return          # it is there (or was, and closed this channel itself)
                if not self._confirm_at_exit():
                    return
            end = self.clock() + EXIT_TAKEOVER_S
            while self.take_over(self.gone_why) is None and self.clock() < end:
                self.sleep(MARKER_POLL_S)
        except Exception as e:  # noqa: BLE001 - never an exit of its own
            log.warning("supervisor watch at exit of rank %d: %s", self.rank, e)

    def _answered_at_exit(self) -> bool:
        """Ping once more; whether the supervisor answered before the silence reached lost_ms."""
        start = self.clock()
        self._ping_now.set()
        while True:
            if not self.thread.is_alive():
                self.tick()
            else:
                self._stop.wait(0.05)
            heard = self.heard()
            if heard is not None and heard >= start:
                return True
            if self.lost_s is not None and self.clock() - heard >= self.lost_s:
                return False

    def _confirm_at_exit(self) -> bool:
        """No answer at exit: ask Slurm (the node's word) until it says the batch host is gone,
        for as long as Slurm takes to see a node go (``SlurmdTimeout`` and two confirmation
        intervals, at least EXIT_CONFIRM_S, at most EXIT_CONFIRM_MAX_S): a power cut leaves the
        host "up" in Slurm's view for that long, and a rank that left at Slurm's first "fine"
        would leave the job running with no batch script. A relaunch by the supervisor (it was
        there after all) ends the wait at once."""
        since = self.clock()
        end = since + min(EXIT_CONFIRM_MAX_S, max(EXIT_CONFIRM_S, self._slurmd_timeout_s() + 2 * CONFIRM_EVERY_S))
        verdict, why = UNKNOWN, "not asked"
        while self.clock() < end:
            verdict, why = self.confirm(self.clock(), since=since, prefix=EXIT_ASK_PREFIX)
            if verdict == GONE:
                break
            if self.relaunched():
                return False        # the supervisor is there: this exit was an ordinary fault
            self.sleep(0.5 if verdict == UNKNOWN else 1.0)
        if verdict == GONE:
            self.confirmed, self.gone_why = True, why
            return True
        log.warning("no answer from the supervisor at the exit of rank %d, but Slurm does not say its batch "
                    "host is gone (%s): nothing done", self.rank, why or "the host is up")
        return False

    # -- the takeover -------------------------------------------------------------------
    def take_over(self, why: str) -> Optional[bool]:
        """Elect one rank and have it requeue the job. True: this rank requeued it; False:
        settled otherwise (another rank asked, the job no longer runs this incarnation, or
        it cannot be done); None: not settled yet (another rank's claim is live, or this
        rank's tries ran out and released the claim): call again later."""
        with self._lock:
            if self.took_over is not None:
                return self.took_over
            try:
                result = self._take_over(why)
            except Exception as e:  # noqa: BLE001 - the watch must never end the training
                log.warning("supervisor gone; takeover by rank %d: %s", self.rank, e)
                result = None
            if result is not None:
                self.took_over = result
            return result

    def _take_over(self, why: str) -> Optional[bool]:
        if not self._staggered:
            self._staggered = True
            self.sleep(min(self.rank, MAX_STAGGER) * STAGGER_S)
        marker = self.attempt / TAKEOVER_FILE
        doc = read_marker(marker)
        says = marker_says(doc, self.clock())
        if says == "done":
            log.info("supervisor gone; rank %s of %s requeued the job", (doc or {}).get("rank", "?"),
                     self.attempt.name)
            return False
        if says == "wait":
            return None             # a live claim: look again later, never give up on it
        gen = 0 if doc is None else int(doc.get("gen", 0)) + 1
        if gen >= MAX_CLAIMS:
            log.warning("supervisor gone; %d takeovers of job %s failed: the ranks give up", gen, self.job_id)
            return False
        body = {"rank": self.rank, "node": self.sender.node, "t": round(self.clock(), 3), "why": why,
                "gen": gen, "state": Takeover.CLAIMED.value, "tries": 0,
                "until": self.clock() + LEASE_S, "lost_recorded": bool((doc or {}).get("lost_recorded"))}
        try:
            if gen == 0:
                won = _create_excl(marker, (json.dumps(body) + "\n").encode())
            else:
                won = _create_excl(self.attempt / f"{TAKEOVER_FILE}.{gen}")
                if won:
                    protocol.write_private(marker, (json.dumps(body) + "\n").encode())
        except OSError as e:
            log.warning("supervisor gone, but the takeover marker %s cannot be made: %s", marker, e)
            return False
        if not won:
            return None             # another rank claimed this generation first: watch it
        return self._requeue_with_retries(marker, body)

    def _mark(self, marker: Path, body: dict, state: Takeover, **fields) -> None:
        body.update(fields, state=state.value)
        try:
            protocol.write_private(marker, (json.dumps(body) + "\n").encode())
        except OSError as e:        # the others then see the lease pass and claim next
            log.warning("takeover marker %s not updated: %s", marker, e)

    def _requeue_with_retries(self, marker: Path, body: dict) -> Optional[bool]:
        from clusterops.slurm.api import Backoff
        from clusterops.supervisor.timeline import EventKind, Timeline

        backoff = Backoff(first_s=TAKEOVER_BACKOFF_S, attempts=TAKEOVER_TRIES, cap_s=8.0)
        tl = Timeline(self.attempt.parent, job_id=self.job_id or None, incarnation=self.incarnation)
        who = {"rank": self.rank, "node": self.sender.node}
        detail = ""
        for n in range(backoff.attempts):
            self._mark(marker, body, Takeover.CLAIMED if n == 0 else Takeover.RETRYING, tries=n,
                       until=self.clock() + LEASE_S)
            outcome, detail = self._try_requeue(tl, who, body, n)
            if outcome is not None:
                self._mark(marker, body, outcome)
                if outcome == Takeover.ASKED:
                    log.warning("supervisor gone (%s); rank %d requeued job %s", body["why"], self.rank, self.job_id)
                return {Takeover.ASKED: True, Takeover.NOT_NEEDED: False}.get(outcome)
            if n + 1 < backoff.attempts:
                pause = backoff.delay(n)
                tl.append(EventKind.TAKEOVER, {**who, "asked": False, "retry_in_s": pause, "why": detail})
                self._mark(marker, body, Takeover.RETRYING, until=self.clock() + pause + LEASE_S)
                self.sleep(pause)
        tl.append(EventKind.TAKEOVER, {**who, "asked": False, "failed": True, "tries": backoff.attempts,
                                       "why": detail})
        log.warning("supervisor gone; requeueing job %s failed %d times: %s", self.job_id, backoff.attempts, detail)
        self._mark(marker, body, Takeover.RELEASED)
        return None

    def _try_requeue(self, tl, who: dict, body: dict, n: int) -> Tuple[Optional[Takeover], str]:
        """One try: (ASKED / NOT_NEEDED / RELEASED, why) when it settles, (None, why) to retry."""
        from clusterops.supervisor.timeline import EventKind

        heard = self.heard()
        silent = None if heard is None else round(self.clock() - heard, 3)
        try:
            slurm = self.slurm_factory()
            job, gone = self._read_gone(slurm)
        except Exception as e:  # noqa: BLE001 - a read that failed says nothing: try again
            return None, f"{type(e).__name__}: {e}"
        if job.state != "RUNNING" or job.restart_count != self.incarnation:
            why = f"the job is {job.state}, restart {job.restart_count}"
            tl.append(EventKind.TAKEOVER, {**who, "asked": False, "why": why})
            return Takeover.NOT_NEEDED, why
        if not gone:
            # Slurm no longer says the host is gone (it answers again): no requeue on an
            # old word; the claim goes back and the watch listens again.
            self.confirmed = False
            tl.append(EventKind.TAKEOVER, {**who, "asked": False, "why": f"the batch host {job.batch_host} is up"})
            return Takeover.RELEASED, "the batch host is up"
        if not body.get("lost_recorded"):
            tl.append(EventKind.SUPERVISOR_LOST, {**who, "silent_s": silent, "why": body["why"] or gone,
                                                  "batch_host": job.batch_host}, t=heard)
            body["lost_recorded"] = True
        # Recorded before it is asked: Slurm ends this process (and the scontrol that
        # asks, often before it exits) as its first answer.
        tl.append(EventKind.TAKEOVER, {**who, "asked": True, "silent_s": silent, **({"try": n} if n else {})})
        try:
            slurm.requeue(self.slurm_job)
        except Exception as e:  # noqa: BLE001 - the requeue kills its own asker: look before saying so
            if not self._requeued(slurm):
                return None, f"{type(e).__name__}: {e}"
        return Takeover.ASKED, ""

    def _requeued(self, slurm) -> bool:
        """Whether Slurm has the job requeued (or ending for it) after this incarnation."""
        try:
            job = slurm.job(self.slurm_job)
        except Exception:  # noqa: BLE001 - cannot say: take the requeue as asked
            return True
        return job.restart_count > self.incarnation or job.state != "RUNNING"
