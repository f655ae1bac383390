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
2. **Gone, not slow.** The beacon says how long a silence means "gone" (``lost_ms``). A
   rank that never heard a beacon (an older supervisor) never declares it lost. A silence
   that long is not enough while this rank's training still makes progress: then the
   watch asks Slurm, at most every :data:`CONFIRM_EVERY_S`, whether the batch host is
   down or no longer in the job; only then does it ask the script to stop
   (``sdk.should_stop()`` is true, reason ``supervisor_lost``), so the ranks save through
   the SDK's atomic commit and leave. A supervisor that is merely slow (a controller
   answering late holds up its watch loop, not its receiving thread) keeps answering; a
   controller slow to answer the watch only delays its confirmation. Silence *and* no
   progress of this rank for the same time (its peers on the lost node are gone, so its
   collectives failed or hang) is taken as the loss without Slurm's word: Slurm ends the
   step as soon as it marks the batch host down (``SlurmdTimeout``), and the ranks must
   have asked for the requeue by then.
3. **At exit** (``atexit``, so also when the script dies of a failed collective), a rank
   with a watch pings once more and waits for the answer, at most until the silence
   reaches ``lost_ms``: a live supervisor answers within milliseconds, so an ordinary
   fault costs no time; no answer means the supervisor is gone.
4. **One requeue.** The ranks that found the supervisor gone elect one: each waits
   ``STAGGER_S`` per rank below it (capped at :data:`MAX_STAGGER`), then creates the
   attempt's ``takeover`` marker on the shared job directory exclusively; the first wins:
   normally the lowest surviving rank, but the nodes heard their last beacons up to an
   interval apart and a loaded node is late, so only "exactly one" is sure. It checks with Slurm that the job still runs
   this incarnation (not already requeued or ended), records ``supervisor_lost`` and
   ``takeover`` in the job's timeline, and requeues the job
   (:meth:`clusterops.slurm.api.SlurmAPI.requeue`). Slurm ends the job's processes,
   holds the job until the lost node is marked down, and starts the next incarnation on
   healthy nodes, which resumes from the latest good checkpoint.

Settings: the silence (``CLUSTEROPS_SUPERVISOR_LOST_S``) is the supervisor's
(:mod:`clusterops.supervisor.channel`), sent in every beacon.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from clusterops import heartbeat as hbc
from clusterops import protocol

log = logging.getLogger("clusterops.watchdog")

BEACON_FILE = "beacon"
PING_PREFIX = "ping-"
TAKEOVER_FILE = "takeover"
#: How often a rank whose training still progresses asks Slurm about a silent supervisor.
CONFIRM_EVERY_S = 5.0
#: The election: a rank waits this long per rank below it before claiming the takeover.
STAGGER_S = 1.0
MAX_STAGGER = 4
#: Stop reason given to the script when the supervisor is found gone.
STOP_REASON = "supervisor_lost"


def _slurm():
    from clusterops.slurm.factory import connect

    return connect(timeout_s=30.0)


class Watchdog:
    """One rank's watch on its supervisor (see the module docstring)."""

    def __init__(self, sender: hbc.NodeSender, *, rank: int, job_id: Optional[str] = None,
                 incarnation: Optional[int] = None, on_lost: Optional[Callable[[str], None]] = None,
                 slurm_factory: Callable[[], object] = _slurm, clock: Callable[[], float] = time.time,
                 start: bool = True):
        self.sender = sender
        self.rank = int(rank)
        self.job_id = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID", "")
        self.incarnation = (int(os.environ.get("SLURM_RESTART_COUNT") or 0)
                            if incarnation is None else int(incarnation))
        self.on_lost = on_lost
        self.slurm_factory = slurm_factory
        self.clock = clock
        self.heard_at: Optional[float] = None    # this rank's last beacon (clock time)
        self.lost_s: Optional[float] = None      # from the last beacon heard
        self.seq = 0
        self.pings = 0
        self.confirmed = False                   # Slurm said the batch host is gone
        self.took_over: Optional[bool] = None    # None: not tried; True: requeued; False: another did
        self.checked_at = -1e18
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

    def heard(self) -> Optional[float]:
        """When a beacon last reached this node (this rank or a neighbour); None: never."""
        best = self.heard_at
        try:
            fields = hbc._read_small(self.beacon_path).split()
            t, lost_ms = float(fields[0]), int(fields[1])
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
        now = self.clock()
        silent = self.silent_for(now)
        if silent is None or self.lost_s is None or silent < self.lost_s or self.took_over is not None:
            return
        if self.stalled(now):
            self.take_over(f"no beacon for {silent:.1f} s and no progress of rank {self.rank} since")
            return
        if not self.confirmed and now - self.checked_at >= CONFIRM_EVERY_S:
            self.checked_at = now
            why = self.batch_host_gone()
            if why:
                self.confirmed = True
                self.gone_why = why
                if self.on_lost is not None:
                    self.on_lost(STOP_REASON)

    def _maybe_ping(self, now: float) -> None:
        slot = int((now - self.sender.phase_s) // self.sender.interval_s)
        if not self._ping_now.is_set():
            try:
                os.close(os.open(os.path.join(self.sender.local, f"{PING_PREFIX}{slot}"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 protocol.PRIVATE_FILE_MODE))
            except FileExistsError:
                return              # a neighbour pings this interval
            except OSError:
                return
            for old in (slot - 2, slot - 3):
                try:
                    os.unlink(os.path.join(self.sender.local, f"{PING_PREFIX}{old}"))
                except OSError:
                    pass
        self._ping_now.clear()
        self.ping()

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
            try:
                protocol.write_private(self.beacon_path, f"{now!r} {b.lost_ms}\n".encode())
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2.0)
        if self.sock is not None:
            self.sock.close()

    # -- Slurm's word -----------------------------------------------------------------
    def batch_host_gone(self) -> str:
        """Why Slurm says the job's batch host is gone ("" when it does not, or cannot say)."""
        if not self.job_id:
            return ""
        try:
            slurm = self.slurm_factory()
            job = slurm.job(self.job_id)
            host = job.batch_host
            if host and job.node_names and host not in job.node_names:
                return f"the batch host {host} is no longer in the job"
            if host and slurm.node(host).is_down:
                return f"the batch host {host} is down"
        except Exception as e:  # noqa: BLE001 - no answer is no confirmation
            log.warning("supervisor watch: Slurm did not answer: %s", e)
        return ""

    # -- at exit -----------------------------------------------------------------------
    def at_exit(self) -> None:
        """Before the process ends: is the supervisor still there? Take over when not."""
        try:
            if self.sock is None or self.took_over is not None:
                return
            start = self.clock()
            if self.heard() is None:
                return              # never heard a beacon: an older supervisor, or none
            if not self.confirmed:
                self._ping_now.set()
                while True:
                    if not self.thread.is_alive():
                        self.tick()
                    else:
                        self._stop.wait(0.05)
                    heard = self.heard()
                    if heard is not None and heard >= start:
                        return      # it answered: it is there, and handles what happens next
                    if self.lost_s is not None and self.clock() - heard >= self.lost_s:
                        break
            self.take_over("no answer at exit" if not self.confirmed else getattr(self, "gone_why", "confirmed"))
        except Exception as e:  # noqa: BLE001 - never an exit of its own
            log.warning("supervisor watch at exit of rank %d: %s", self.rank, e)

    # -- the takeover -------------------------------------------------------------------
    def take_over(self, why: str) -> bool:
        """Elect one rank and have it requeue the job; True when this rank requeued it.
        Once per watch: a second call (the thread and the exit) waits for the first."""
        with self._lock:
            if self.took_over is not None:
                return self.took_over
            try:
                return self._take_over(why)
            finally:
                if self.took_over is None:
                    self.took_over = False

    def _take_over(self, why: str) -> bool:
        attempt = Path(self.sender.hb_dir).parent
        job_dir = attempt.parent
        time.sleep(min(self.rank, MAX_STAGGER) * STAGGER_S)
        marker = attempt / TAKEOVER_FILE
        body = {"rank": self.rank, "node": self.sender.node, "t": round(self.clock(), 3), "why": why}
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            log.info("supervisor gone; rank %s of %s requeues the job", _peek(marker), attempt.name)
            return False
        except OSError as e:
            log.warning("supervisor gone, but the takeover marker %s cannot be made: %s", marker, e)
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(body) + "\n")
        heard = self.heard()
        silent = None if heard is None else round(self.clock() - heard, 3)
        from clusterops.supervisor.timeline import EventKind, Timeline

        tl = Timeline(job_dir, job_id=self.job_id or None, incarnation=self.incarnation)
        who = {"rank": self.rank, "node": self.sender.node}
        try:
            slurm = self.slurm_factory()
            job = slurm.job(self.job_id)
            if job.state != "RUNNING" or job.restart_count != self.incarnation:
                tl.append(EventKind.TAKEOVER, {**who, "asked": False,
                                               "why": f"the job is {job.state}, restart {job.restart_count}"})
                return False
            tl.append(EventKind.SUPERVISOR_LOST, {**who, "silent_s": silent, "why": why,
                                                  "batch_host": job.batch_host}, t=heard)
            # Recorded before it is asked: Slurm ends this process (and the scontrol that
            # asks, often before it exits) as its first answer.
            tl.append(EventKind.TAKEOVER, {**who, "asked": True, "silent_s": silent})
        except Exception as e:  # noqa: BLE001 - said in the timeline; nothing else can be done
            tl.append(EventKind.TAKEOVER, {**who, "asked": False, "why": f"{type(e).__name__}: {e}"})
            log.warning("supervisor gone; job %s not requeued: %s", self.job_id, e)
            return False
        try:
            slurm.requeue(self.job_id)
        except Exception as e:  # noqa: BLE001 - the requeue kills its own asker: look before saying so
            if not self._requeued(slurm):
                tl.append(EventKind.TAKEOVER, {**who, "asked": False, "failed": True,
                                               "why": f"{type(e).__name__}: {e}"})
                log.warning("supervisor gone; requeueing job %s failed: %s", self.job_id, e)
                return False
        log.warning("supervisor gone (%s); rank %d requeued job %s", why, self.rank, self.job_id)
        self.took_over = True
        return True

    def _requeued(self, slurm) -> bool:
        """Whether Slurm has the job requeued (or ending for it) after this incarnation."""
        try:
            job = slurm.job(self.job_id)
        except Exception:  # noqa: BLE001 - cannot say: take the requeue as asked
            return True
        return job.restart_count > self.incarnation or job.state != "RUNNING"


def _peek(marker: Path) -> str:
    try:
        return str(json.loads(marker.read_text()).get("rank"))
    except (OSError, ValueError, AttributeError):
        return "?"
