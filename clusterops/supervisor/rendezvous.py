"""The rendezvous the supervisor hosts for in-process recovery (``supervise: inprocess:``).

One ``torch.distributed.TCPStore`` (torch's own store, not a store of ours) lives in the
supervisor for the whole training step, so it outlives every generation of the process
group: each generation forms its group on a prefix of it (``pg/<G>/``). The store trusts
whoever connects (any client can list, read, overwrite and delete every key), so nothing
here trusts the store: every value is sealed with a fresh per-attempt secret
(:mod:`clusterops.rdzvstore`: encrypted and authenticated, bound to its key), which only the
job's processes hold (the ``TOKEN`` of the address ``HOST:PORT/TOKEN`` the ranks get in
:data:`clusterops.protocol.ENV_RDZV_ADDR`; it never appears in the store). A value that does
not open is a stranger's and is ignored: a report, a join, a beat, a plan, a kill order, an
abort, the finish mark, and the addresses the process groups form on. What a stranger who
reaches the port can still do is delete or overwrite values and bump counters: that delays
a recovery until its timeout (then the relaunch follows), it never steers one.

A thread reads the processes' reports (:mod:`clusterops.protocol`'s ``rep/<n>`` keys, and
the survivors' joins, one sealed line each appended to ``join/<G>``: one round trip a rank)
as they come, feeds them to :class:`clusterops.supervisor.membership.Membership` (every
decision is made there) and carries its actions out: a generation's plan is written to
``plan/<G>`` (and ``abort/<G>`` as soon as a fault opens generation G, for the ranks'
NCCL abort watchers), a hung rank is SIGKILLed by the standbys of its node (``kill/<uid>``;
they kill only a process of their own job step that the current plan names), a
fallback is left for the supervisor's loop (:attr:`RendezvousHost.fallback`), so is a
standby to start in a used one's place (:meth:`RendezvousHost.drain_refills`), and the
timeline records wait in :meth:`RendezvousHost.drain_notes` for the loop to write (the
timeline has one writer). torch is imported here only when a host starts (``import
clusterops`` and the CLI never import it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from clusterops import protocol
from clusterops import rdzvstore
from clusterops.supervisor.membership import Fallback, KillProcess, Membership, Note, Publish, Report, StartStandby

log = logging.getLogger(__name__)

POLL_S = 0.01
REPORT_BATCH = 1024
#: a report whose counter slot stays empty (or holds no authentic value) this long is skipped:
#: a writer that died between its add and its set, or a stranger who bumped the counter
REPORT_GAP_S = 2.0
GAP_SCAN = 4096


@dataclass(frozen=True)
class InprocessSettings:
    """``supervise: inprocess:`` (the fields and defaults are clusterops.schema's)."""

    standbys_per_node: int = 1
    timeout_s: float = 30.0
    unresponsive_s: float = 10.0
    refill: bool = True


class RendezvousHost:
    """The store and the thread that decides generations, for one training step."""

    def __init__(self, membership: Membership, *, bind_host: str = "0.0.0.0", advertise_host: str = "127.0.0.1",
                 clock: Callable[[], float] = time.time, store_timeout_s: float = 60.0):
        self.membership = membership
        self.clock = clock
        self.token = rdzvstore.new_secret()     # the attempt's secret: never written into the store
        self.sealer = rdzvstore.Sealer(self.token)
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.store_timeout_s = store_timeout_s
        self.store = None          # the TCPStore server (and a client of it: this thread's)
        self.port = 0
        self.fallback: Optional[str] = None
        self.fallback_acted = False      # the supervisor killed the step for it
        self._notes: List[Note] = []
        self._hung: List[Sequence[int]] = []
        self._ended: List[Report] = []
        self._refills: List[StartStandby] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next = 1
        self._gap: tuple = (0, 0.0)              # (the report slot waited for, since when)
        self._joins_read: Dict[int, int] = {}    # generation -> bytes of join/<G> read
        self._uid_of: tuple = (None, {})
        self._beats: Dict[str, tuple] = {}      # node -> (its beat counter, when it last moved)
        self._beats_for: Optional[int] = None   # the generation being formed they were read for
        self._beats_at = 0.0
        self.error: Optional[str] = None

    @classmethod
    def for_attempt(cls, settings: InprocessSettings, nodes: Sequence[str], ranks_per_node: int,
                    advertise_host: str, *, clock: Callable[[], float] = time.time,
                    spares: Sequence[str] = ()) -> "RendezvousHost":
        """A started host for one training step on ``nodes`` (``spares``: nodes of the job
        that run standbys only)."""
        m = Membership(nodes, ranks_per_node, settings.standbys_per_node, timeout_s=settings.timeout_s,
                       unresponsive_s=settings.unresponsive_s, refill=settings.refill, spares=spares,
                       confirm_alive=True, silent_s=protocol.RDZV_SILENT_S)
        return cls(m, advertise_host=advertise_host, clock=clock).start()

    @property
    def addr(self) -> str:
        return f"{self.advertise_host}:{self.port}/{self.token}"

    @property
    def finished(self) -> bool:
        return self.membership.finished

    def start(self) -> "RendezvousHost":
        import datetime

        import torch.distributed as dist

        server = dist.TCPStore(self.bind_host, 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=self.store_timeout_s))
        self.port = server.port
        self.server = server
        self.store = rdzvstore.SealedStore(server, self.sealer, self.store_timeout_s)
        self._thread = threading.Thread(target=self._loop, name="clusterops-rdzv", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.store = None
        self.server = None

    # -------------------------------------------------------------- the loop's inputs
    def hung(self, ranks: Sequence[int]) -> None:
        """The supervisor's hang detection named these ranks (thread-safe)."""
        with self._lock:
            self._hung.append(tuple(ranks))

    def task_ended(self, task: int, node: str, reason: str) -> None:
        """srun said task ``task`` (SLURM_PROCID) of the step ended (thread-safe)."""
        with self._lock:
            self._ended.append(Report("dead", "srun", {"task": int(task), "node": node, "reason": reason}))

    def drain_refills(self) -> List[StartStandby]:
        """Standbys to start in used ones' places (the supervisor starts them: a Slurm step)."""
        with self._lock:
            out, self._refills = self._refills, []
        return out

    def drain_notes(self) -> List[Note]:
        with self._lock:
            out, self._notes = self._notes, []
        return out

    # -------------------------------------------------------------- the thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._once()
                self._stop.wait(POLL_S)
        except Exception as e:  # the store failed under us: the relaunch path takes over
            self.error = f"{type(e).__name__}: {e}"
            with self._lock:
                self._notes.append(Note("inproc_fallback", {"reason": f"rendezvous store failed: {self.error}"}))
            self.fallback = self.fallback or f"rendezvous store failed: {self.error}"

    def _once(self) -> None:
        store, m = self.store, self.membership
        actions: List[object] = []
        for raw in self._read_reports():
            try:
                body = json.loads(raw)
                rep = Report(str(body.pop("kind")), str(body.pop("uid")), body)
            except (ValueError, KeyError, TypeError, AttributeError):
                actions.append(Note("warning", {"what": f"rendezvous: unreadable report {raw[:80]!r}"}))
                continue
            actions += m.handle(rep, self.clock())
        actions += self._read_joins()
        with self._lock:
            hung, self._hung = self._hung, []
            ended, self._ended = self._ended, []
        for rep in ended:
            actions += m.handle(rep, self.clock())
        for ranks in hung:
            actions += m.hung(ranks, self.clock())
        actions += self._read_beats()
        actions += m.tick(self.clock())
        for a in actions:
            self._act(a)
        if m.finished and store.peek(protocol.RDZV_FINISH) is None:
            store.set(protocol.RDZV_FINISH, "1")

    def _read_reports(self) -> List[bytes]:
        """The reports written since the last read, in order (sealed ``rep/<i>``, the slots the
        counter ``rep/n`` handed out): in batches, one round trip for many (16k ranks rejoin at
        once). A slot that is empty or holds no authentic value is waited for (a writer adds,
        then sets) for REPORT_GAP_S, then skipped (:meth:`_skip_gap`)."""
        store = self.store
        n = store.add(protocol.RDZV_REPORTS, 0)
        out: List[bytes] = []
        while self._next <= n:
            upto = min(n, self._next + REPORT_BATCH - 1)
            keys = [protocol.rdzv_key("rep", i) for i in range(self._next, upto + 1)]
            if store.exists(keys):
                values = store.peek_many(keys)
            else:                         # one by one up to the first slot not written yet
                values = []
                for k in keys:
                    values.append(store.peek(k))
                    if values[-1] is None:
                        break
            for v in values:
                if v is None:
                    break
                out.append(v)
                self._next += 1
            if self._next <= upto:        # slot self._next: not (yet) there
                now = self.clock()
                if self._gap[0] != self._next:
                    self._gap = (self._next, now)
                elif now - self._gap[1] >= REPORT_GAP_S:
                    self._skip_gap(n)
                    continue
                break
        return out

    def _skip_gap(self, n: int) -> None:
        """Slot ``self._next`` stayed empty: go on from the first slot after the last empty one
        below the newest reports (a bumped counter leaves a run of empty slots; the newest
        slots may still be being written, so the empty ones at the very top are kept)."""
        store, i = self.store, self._next
        j, seen_present = n, False
        while j > i and n - j < GAP_SCAN:
            there = store.peek(protocol.rdzv_key("rep", j)) is not None
            if there:
                seen_present = True
            elif seen_present:
                break
            j -= 1
        skip_to = j + 1 if (seen_present and j > i) else i + 1
        with self._lock:
            self._notes.append(Note("warning", {"what": f"rendezvous: report slots {i}-{skip_to - 1} held no "
                                                        f"authentic report for {REPORT_GAP_S:g} s: skipped"}))
        self._next = skip_to
        self._gap = (0, 0.0)

    def _read_beats(self) -> List[object]:
        """During a recovery, the beats of two kinds of node: those whose ranks have not
        rejoined (every RDZV_BEAT_S) and those of the lost ranks, whose own standby may take
        the rank only once their beat moves (every loop: a same-node heal waits one beat).
        A beat is a sealed time stamp (``beat/<node>``); it moves when a newer one is there (a
        stranger's replay of an older one does not). A node whose beat has not moved for
        RDZV_SILENT_S is lost whole (``silent``). One check and one multi_get a read, for
        those nodes only."""
        m, now = self.membership, self.clock()
        rec = m.recovery
        if rec is None or rec.published_at is not None:
            return []
        if self._beats_for != rec.gen:          # a new recovery: every node starts afresh
            self._beats, self._beats_for = {}, rec.gen
        nodes = set(m.confirm_nodes())
        if now - self._beats_at >= protocol.RDZV_BEAT_S:
            self._beats_at = now
            nodes.update(m.watch_nodes())
        nodes = sorted(nodes)
        keys = [protocol.rdzv_key("beat", n) for n in nodes]
        if not nodes or not self.store.exists(keys):
            return []
        out: List[object] = []
        for node, raw in zip(nodes, self.store.peek_many(keys)):
            value = protocol.parse_rdzv_beat(raw)
            seen = self._beats.get(node)
            if seen is None:
                self._beats[node] = (value, now)
            elif value > seen[0]:
                self._beats[node] = (value, now)
                out += m.beat_seen(node, now)
            elif now - seen[1] >= protocol.RDZV_SILENT_S:
                out += m.handle(Report("silent", "host", {"node": node, "seconds": round(now - seen[1], 2)}), now)
        return out

    def _read_joins(self) -> List[object]:
        """The survivors' joins for the next generation (``join/<G>``, one sealed line appended
        a rank, naming its uid): what was added since the last read, as membership reports. A
        line that does not open, or whose uid is not the plan's holder of that rank, is no join."""
        m, store = self.membership, self.store
        if m.plan is None:
            return []
        gen = m.gen + 1
        key = protocol.rdzv_key("join", gen)
        if not store.exists([key]):
            return []
        chunk, end = rdzvstore.lines_of(store.raw.get(key), self._joins_read.get(gen, 0))
        if not chunk:
            return []
        self._joins_read[gen] = end
        if self._uid_of[0] != m.gen:        # rank -> uid of the plan the joins leave
            self._uid_of = (m.gen, {r: u for u, r in m.plan.ranks.items()})
        uid_of = self._uid_of[1]
        out: List[object] = []
        now = self.clock()
        for uid, rank, step in protocol.parse_rdzv_joins(store.sealer.open_lines(key, chunk)):
            if uid_of.get(rank) == uid:
                out += m.handle(Report("join", uid, {"gen": gen, "rank": rank, "step": step}), now)
        return out

    def _act(self, a: object) -> None:
        if isinstance(a, Publish):
            self.store.set(protocol.rdzv_key("plan", a.plan.gen), json.dumps(a.plan.to_json()))
        elif isinstance(a, KillProcess):
            self.store.set(protocol.rdzv_key("kill", a.uid), a.node)
        elif isinstance(a, Fallback):
            self.fallback = a.reason
            # The ranks stop waiting: the relaunch ends them anyway, sooner if they exit.
            self.store.set(protocol.RDZV_FINISH, "fallback")
            with self._lock:
                self._notes.append(Note("inproc_fallback", {"reason": a.reason}))
        elif isinstance(a, StartStandby):
            with self._lock:
                self._refills.append(a)
        elif isinstance(a, Note):
            if a.kind == "inproc_fault":   # the ranks' abort watchers (NCCL) unblock their collectives
                self.store.set(protocol.rdzv_key("abort", int(a.data.get("gen", -1)) + 1), str(a.data.get("first", "")))
            with self._lock:
                self._notes.append(a)
