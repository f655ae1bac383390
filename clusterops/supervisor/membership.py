"""Who trains in each generation of an in-process recovery: the supervisor's pure decisions.

With ``supervise: inprocess:`` the training step starts, on every node, the ranks and
``standbys_per_node`` warm standby processes (the script imported, waiting for a rank).
Every process reports to the rendezvous the supervisor hosts
(:mod:`clusterops.supervisor.rendezvous`); this module decides, from those reports alone,
what happens: which process holds which rank in generation G, when a fault opens
generation G+1, which standby takes a lost rank's place (on the same node first, else on
another node: a spare), which survivor's state the newcomers receive, when to kill a rank
that neither answers nor dies (a hang), and when to give the in-process path up for the
supervisor's full relaunch (a timeout, the same rank failing twice, a fault during a
recovery, no standby left). A lost rank goes to a standby on its own node when the node
lives, else to one on a spare node (a node of the job that holds no rank: its standbys
run as a step of their own), else to any standby left. Plain values in, plain values out, the clock passed in;
nothing here touches a process or a socket.

Reports (``Report.kind``):

===========  ====================================================================
``hello``    a process of the step started: ``uid``, ``node``, ``local`` (SLURM_LOCALID),
             ``task`` (SLURM_PROCID); after the first plan: a standby started in a used
             one's place (:class:`StartStandby`, a Slurm step of its own), added to the pool
``fail``     a rank's collective failed in generation ``gen`` (``rank``, ``step``)
``join``     a survivor waits for generation ``gen`` (``rank``, ``step`` it holds)
``dead``     a standby saw a process of its node vanish (``dead``: its uid), or srun said a
             task ended (uid ``srun``, ``task``: its SLURM_PROCID)
``stopped``  a standby saw a rank of its node stopped (``dead``: its uid; SIGSTOP)
``silent``   the host saw a node go quiet during a recovery (``node``, ``seconds``): its
             standbys beat the store (``beat/<node>``) while they wait and stopped, so the
             node is lost whole (a power cut, a dead slurmd with its tasks): every process
             of it counts dead
``state``    rank 0 of ``gen`` received the state (``seconds``, ``src``); sharded:
             loaded it from the checkpoint (``source="checkpoint"``, ``step`` the
             checkpoint's, ``survivors_step``, ``recomputed``)
``step``     rank 0 of ``gen`` finished its first training step there (``step``; sharded:
             ``from_step``, ``recomputed``)
``done``     a rank finished the training (``rank``, ``step``)
===========  ====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple


@dataclass(frozen=True)
class Report:
    kind: str
    uid: str
    data: Dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """Generation ``gen``: ``ranks`` maps a process uid to its rank; ``src`` is the rank whose
    state every rank loads (None: generation 0, the state each process built or resumed);
    ``step`` the step that state holds."""

    gen: int
    world: int
    ranks: Dict[str, int]
    standby: Tuple[str, ...]
    src: Optional[int] = None
    step: Optional[int] = None

    def to_json(self) -> dict:
        return {"gen": self.gen, "world": self.world, "ranks": dict(self.ranks), "standby": list(self.standby),
                "src": self.src, "step": self.step}


@dataclass(frozen=True)
class Publish:
    plan: Plan


@dataclass(frozen=True)
class KillProcess:
    """Ask the standbys of ``node`` to SIGKILL the process ``uid`` (a rank that hangs)."""

    node: str
    uid: str


@dataclass(frozen=True)
class StartStandby:
    """Start a new warm standby on ``node``: the one there (``used``, its uid) took a lost
    rank's place and the new generation trains, so a second fault on the node can heal
    in-process too."""

    node: str
    used: str


@dataclass(frozen=True)
class Fallback:
    """Give the in-process path up: the supervisor relaunches the whole step."""

    reason: str


@dataclass(frozen=True)
class Note:
    """A timeline record (``kind`` one of the ``inproc_*`` event kinds)."""

    kind: str
    data: Dict[str, object]


@dataclass
class _Proc:
    uid: str
    node: str
    local: int
    alive: bool = True
    task: int = -1


@dataclass
class _Recovery:
    gen: int                  # the generation being formed
    since: float              # when the fault was first heard of
    first: str                # what was heard first
    dead: Set[int] = field(default_factory=set)       # ranks of the old generation that are gone
    joined: Dict[int, int] = field(default_factory=dict)   # rank -> step, survivors waiting
    kill_sent: Set[str] = field(default_factory=set)
    published_at: Optional[float] = None
    moves: List[dict] = field(default_factory=list)   # who replaced whom (the plan's note)
    first_join_at: Optional[float] = None   # the first survivor had destroyed its group (the abort's end)


class Membership:
    """The generations of one training step (one attempt)."""

    def __init__(self, nodes: Sequence[str], ranks_per_node: int, standbys_per_node: int, *,
                 timeout_s: float = 30.0, unresponsive_s: float = 3.0, refill: bool = False,
                 spares: Sequence[str] = (), confirm_alive: bool = False, silent_s: float = 3.0):
        self.nodes = list(nodes)
        # confirm_alive: give a lost rank to a standby of its own node only once that node's
        # beat has moved since the fault (beat_seen): a node lost whole may not be known so
        # yet (its standby cannot say it died), and a plan naming a dead standby falls back.
        # Unconfirmed for silent_s, the node is lost (the host reports it silent).
        self.confirm_alive = bool(confirm_alive)
        self.silent_s = float(silent_s)
        self.alive_at: Dict[str, float] = {}     # node -> when its beat was last seen moving
        self.spares = [n for n in spares if n not in self.nodes]   # standbys only (steps of their own)
        self.ppn = int(ranks_per_node)
        self.spn = int(standbys_per_node)
        self.world = len(self.nodes) * self.ppn
        self.timeout_s = float(timeout_s)
        self.unresponsive_s = float(unresponsive_s)
        self.refill = bool(refill)
        self.refills = 0          # standbys asked for in a used one's place
        self.procs: Dict[str, _Proc] = {}
        self.plan: Optional[Plan] = None
        self.recovery: Optional[_Recovery] = None
        self.failures: Dict[int, int] = {}       # rank -> faults it was lost in
        self.fallen_back: Optional[str] = None
        self.finished = False
        self.done_ranks: Set[int] = set()
        self.recoveries = 0
        self.lost_nodes: Set[str] = set()        # nodes gone whole (``silent``)

    def lost_tasks(self) -> Set[int]:
        """srun task numbers of the processes that died while the step went on (healed, or
        standbys): their failures in the step's output are not the step's."""
        return {p.task for p in self.procs.values() if not p.alive}

    def gone_nodes(self) -> Set[str]:
        """Nodes of which no process lives: lost whole (``silent``), or every process of it
        reported dead one by one (srun's word for each task). Their ranks were healed or the
        recovery fell back; either way the step's end need not wait for them."""
        alive = {p.node for p in self.procs.values() if p.alive}
        return self.lost_nodes | {p.node for p in self.procs.values() if p.node not in alive}

    @property
    def expected_procs(self) -> int:
        return len(self.nodes) * (self.ppn + self.spn)

    @property
    def gen(self) -> int:
        return -1 if self.plan is None else self.plan.gen

    def rank_node(self, rank: int) -> str:
        uid = self._uid_of(rank)
        return self.procs[uid].node if uid in self.procs else self.nodes[rank // self.ppn]

    def _uid_of(self, rank: int) -> Optional[str]:
        if self.plan is None:
            return None
        for uid, r in self.plan.ranks.items():
            if r == rank:
                return uid
        return None

    # -------------------------------------------------------------------- reports
    def handle(self, rep: Report, now: float) -> List[object]:
        if self.fallen_back is not None or self.finished:
            return []
        fn = getattr(self, f"_on_{rep.kind}", None)
        if fn is None:
            return [Note("warning", {"what": f"rendezvous: unknown report {rep.kind!r} from {rep.uid}"})]
        return fn(rep, now)

    def _on_hello(self, rep: Report, now: float) -> List[object]:
        d = rep.data
        if self.plan is not None:
            return self._late_hello(rep, now)
        node = str(d.get("node", ""))
        # A spare node's standbys run as a step of their own: no task of the training step,
        # and not waited for (the first plan takes them when they are there).
        task = -1 if node in self.spares else int(d.get("task", -1))
        self.procs[rep.uid] = _Proc(rep.uid, node, int(d.get("local", 0)), task=task)
        if sum(1 for p in self.procs.values() if p.node not in self.spares) >= self.expected_procs:
            return [Publish(self._first_plan())]
        return []

    def _late_hello(self, rep: Report, now: float) -> List[object]:
        """A process that says hello after the first plan: a standby started in a used one's
        place (its own Slurm step, so its task number is not the training step's: -1). It
        joins the pool the next plan draws from."""
        if rep.uid in self.procs:
            return []
        node = str(rep.data.get("node", ""))
        self.procs[rep.uid] = _Proc(rep.uid, node, int(rep.data.get("local", 0)), task=-1)
        self.plan = replace(self.plan, standby=self.plan.standby + (rep.uid,))
        return [Note("inproc_standby", {"node": node, "uid": rep.uid, "at": round(now, 3)})]

    def _first_plan(self) -> Plan:
        ranks: Dict[str, int] = {}
        standby: List[str] = []
        by_node: Dict[str, List[_Proc]] = {}
        for p in self.procs.values():
            by_node.setdefault(p.node, []).append(p)
        for i, node in enumerate(self.nodes):
            here = sorted(by_node.get(node, []), key=lambda p: p.local)
            for j, p in enumerate(here):
                if j < self.ppn:
                    ranks[p.uid] = i * self.ppn + j
                else:
                    standby.append(p.uid)
        # Processes on a node the plan does not know (should not happen): standbys too.
        known = set(ranks) | set(standby)
        standby += sorted(u for u in self.procs if u not in known)
        self.plan = Plan(0, self.world, ranks, tuple(standby))
        return self.plan

    def _open(self, now: float, first: str, out: List[object]) -> _Recovery:
        if self.recovery is None:
            self.recovery = _Recovery(gen=self.gen + 1, since=now, first=first)
            out.append(Note("inproc_fault", {"gen": self.gen, "first": first, "at": round(now, 3)}))
        return self.recovery

    def _lost(self, rank: int, now: float, out: List[object]) -> bool:
        """Rank of the current plan is gone; False when that means falling back."""
        rec = self._open(now, f"rank {rank} lost", out)
        if rank in rec.dead:
            return True
        rec.dead.add(rank)
        # A survivor that joined and then died is no source: its join goes with it.
        rec.joined.pop(rank, None)
        self.failures[rank] = self.failures.get(rank, 0) + 1
        if self.failures[rank] >= 2:
            out.append(self._fallback(f"rank {rank} failed a second time"))
            return False
        return True

    def _on_fail(self, rep: Report, now: float) -> List[object]:
        out: List[object] = []
        gen = int(rep.data.get("gen", -1))
        rec = self.recovery
        if rec is not None and rec.published_at is not None and gen == rec.gen:
            out.append(self._fallback(f"a second fault during the recovery to generation {rec.gen} "
                                      f"(rank {rep.data.get('rank')}: {rep.data.get('error', '')})"))
            return out
        if gen != self.gen:
            return out
        self._open(now, f"rank {rep.data.get('rank')}: {rep.data.get('error', 'collective failed')}", out)
        return out + self._try_publish(now)

    def _on_join(self, rep: Report, now: float) -> List[object]:
        out: List[object] = []
        if self.plan is None or rep.uid not in self.plan.ranks:
            return out
        rec = self._open(now, f"rank {rep.data.get('rank')} asked for a new generation", out)
        if int(rep.data.get("gen", -1)) != rec.gen or rec.published_at is not None:
            return out
        rank = self.plan.ranks[rep.uid]
        p = self.procs.get(rep.uid)
        if rank in rec.dead or p is None or not p.alive:   # a late or stale join of a process gone
            return out
        rec.joined[rank] = int(rep.data.get("step", 0))
        if rec.first_join_at is None:
            rec.first_join_at = now
        return out + self._try_publish(now)

    def _on_dead(self, rep: Report, now: float) -> List[object]:
        out: List[object] = []
        uid = str(rep.data.get("dead"))
        if "task" in rep.data:     # srun's word: find the process by its task number
            uid = next((u for u, p in self.procs.items() if p.task == int(rep.data["task"])), "")
        p = self.procs.get(uid)
        if p is None or not p.alive:
            return out
        p.alive = False
        if self.plan is None:
            out.append(self._fallback(f"process {uid} died before the first generation"))
            return out
        rank = self.plan.ranks.get(uid)
        if rank is None:     # a standby: one spare fewer
            out.append(Note("warning", {"what": f"standby {uid} on {p.node} died"}))
            return out
        rec = self.recovery
        if rec is not None and rec.published_at is not None:
            out.append(self._fallback(f"rank {rank} ({uid}) died during the recovery to generation {rec.gen}"))
            return out
        if not self._lost(rank, now, out):
            return out
        return out + self._try_publish(now)

    def _on_stopped(self, rep: Report, now: float) -> List[object]:
        rank = self.plan.ranks.get(str(rep.data.get("dead"))) if self.plan is not None else None
        if rank is None:
            return []
        return self.hung([rank], now)

    def _on_state(self, rep: Report, now: float) -> List[object]:
        return [Note("inproc_state", dict(rep.data, at=round(now, 3)))]

    def _on_step(self, rep: Report, now: float) -> List[object]:
        rec = self.recovery
        if rec is None or int(rep.data.get("gen", -1)) != rec.gen:
            return []
        self.recovery = None
        self.recoveries += 1
        out: List[object] = []
        if self.refill:
            for mv in rec.moves:
                if self._healthy(mv["to"]):
                    self.refills += 1
                    out.append(StartStandby(mv["to"], mv["uid"]))
        note = {"gen": rec.gen, "step": rep.data.get("step"), "fault_to_step_s": round(now - rec.since, 3),
                "at": round(now, 3), "lost": sorted(rec.dead), "first": rec.first}
        # sharded (from the checkpoint): the step it resumed from and the steps recomputed
        note.update({k: rep.data[k] for k in ("from_step", "recomputed") if k in rep.data})
        return out + [Note("inproc_first_step", note)]

    def _healthy(self, node: str) -> bool:
        """The node answers: a rank of the current plan lives there (the standby that took
        the lost rank's place, at least). A node lost whole has no live process left."""
        ranks = self.plan.ranks if self.plan is not None else {}
        return any(p.alive and p.node == node and u in ranks for u, p in self.procs.items())

    def _on_done(self, rep: Report, now: float) -> List[object]:
        if self.plan is not None and rep.uid in self.plan.ranks:
            self.done_ranks.add(self.plan.ranks[rep.uid])
        if len(self.done_ranks) >= self.world:
            self.finished = True
        return []

    # -------------------------------------------------------------------- decisions
    def _try_publish(self, now: float) -> List[object]:
        rec, plan = self.recovery, self.plan
        if rec is None or plan is None or rec.published_at is not None:
            return []
        # Counted before the set is built: one join after another costs O(1), not O(world).
        if len(rec.joined) + len(rec.dead) < plan.world or len(rec.joined.keys() | rec.dead) < plan.world:
            return []
        if not rec.joined:
            return [self._fallback("no survivor to take the state from")]
        if self.confirm_nodes():       # a lost rank's node: alive (its own standby) or lost? wait
            return []
        ranks = {u: r for u, r in plan.ranks.items() if r not in rec.dead}
        free = [u for u in plan.standby if self.procs.get(u) and self.procs[u].alive]
        moves = []
        for rank in sorted(rec.dead):
            node = self.rank_node(rank)
            pick = self._pick(free, node, ranks)
            if pick is None:
                return [self._fallback(f"no standby left for rank {rank}")]
            free.remove(pick)
            ranks[pick] = rank
            moves.append({"rank": rank, "from": node, "to": self.procs[pick].node, "uid": pick})
        # The source: a survivor of the old generation that joined and still lives (its process
        # holds the rank in the plan the joins leave), at the highest step.
        holder = {r: u for u, r in plan.ranks.items()}
        live = {r: st for r, st in rec.joined.items()
                if r not in rec.dead and holder.get(r) in self.procs and self.procs[holder[r]].alive}
        if not live:
            return [self._fallback("no live survivor to take the state from")]
        top = max(live.values())
        src = min(r for r, st in live.items() if st == top)
        self.plan = Plan(rec.gen, plan.world, ranks, tuple(free), src=src, step=top)
        rec.published_at = now
        rec.moves = moves
        abort = (rec.first_join_at if rec.first_join_at is not None else now) - rec.since
        return [Note("inproc_rendezvous", {"gen": rec.gen, "wait_s": round(now - rec.since, 3),
                                           "abort_s": round(abort, 3), "src": src, "step": top,
                                           "replaced": moves, "at": round(now, 3)}),
                Publish(self.plan)]

    def _pick(self, free: List[str], node: str, ranks: Dict[str, int]) -> Optional[str]:
        """The standby for a rank lost on ``node``: one of the node itself (it lives: the
        lost process's devices are free there), else one on the node holding the fewest ranks
        of the new plan (a spare holds none), first in the pool on a tie."""
        same = next((u for u in free if self.procs[u].node == node and node not in self.lost_nodes), None)
        if same is not None or not free:
            return same
        load: Dict[str, int] = {}
        for u in ranks:
            if u in self.procs:
                load[self.procs[u].node] = load.get(self.procs[u].node, 0) + 1
        return min(free, key=lambda u: (self.procs[u].node == node, load.get(self.procs[u].node, 0), free.index(u)))

    def _free_standby_on(self, node: str) -> bool:
        plan = self.plan
        return plan is not None and any(self.procs.get(u) and self.procs[u].alive and self.procs[u].node == node
                                        for u in plan.standby)

    def confirm_nodes(self) -> List[str]:
        """Nodes whose beat must move before a lost rank of theirs goes to their own standby
        (``confirm_alive``): those of the ranks lost in the open recovery, not yet confirmed."""
        rec = self.recovery
        if not self.confirm_alive or rec is None or rec.published_at is not None:
            return []
        nodes = {self.rank_node(r) for r in rec.dead}
        return sorted(n for n in nodes if n not in self.lost_nodes and self.alive_at.get(n, float("-inf")) < rec.since
                      and self._free_standby_on(n))

    def beat_seen(self, node: str, now: float) -> List[object]:
        """The host saw ``node``'s beat move: the node lives."""
        self.alive_at[node] = now
        return self._try_publish(now) if self.recovery is not None else []

    def watch_nodes(self) -> List[str]:
        """Nodes whose standbys' beats decide, during a recovery, whether the node lives: those
        of the old generation's ranks that neither rejoined nor are known lost, where a
        standby lives to beat (a node without one is decided by ``unresponsive_s``)."""
        rec, plan = self.recovery, self.plan
        if rec is None or plan is None or rec.published_at is not None:
            return []
        nodes = set()
        for uid, rank in plan.ranks.items():
            if rank in rec.joined or rank in rec.dead:
                continue
            p = self.procs.get(uid)
            if p is not None and p.node not in self.lost_nodes:
                nodes.add(p.node)
        with_standby = {p.node for u, p in self.procs.items() if p.alive and u in plan.standby}
        return sorted(nodes & with_standby)

    def _on_silent(self, rep: Report, now: float) -> List[object]:
        node = str(rep.data.get("node", ""))
        if self.plan is None or node in self.lost_nodes:
            return []
        self.lost_nodes.add(node)
        out: List[object] = []
        rec = self._open(now, f"node {node} lost", out)
        gone = sorted((u for u, p in self.procs.items() if p.node == node and p.alive),
                      key=lambda u: self.plan.ranks.get(u, self.world))
        out.append(Note("inproc_node_lost", {"node": node, "silent_s": rep.data.get("seconds"),
                                             "procs": len(gone), "at": round(now, 3)}))
        if rec.published_at is not None and any(u in self.plan.ranks for u in gone):
            out.append(self._fallback(f"node {node} lost during the recovery to generation {rec.gen}"))
            return out
        for uid in gone:
            self.procs[uid].alive = False
            rank = self.plan.ranks.get(uid)
            if rank is not None and not self._lost(rank, now, out):
                return out
        return out + self._try_publish(now)

    def tick(self, now: float) -> List[object]:
        """Timeouts: kill a rank that neither joined nor died; fall back past ``timeout_s``."""
        rec = self.recovery
        if rec is None or self.fallen_back is not None or self.plan is None:
            return []
        if now - rec.since > self.timeout_s:
            what = "the new generation's first step" if rec.published_at else "the rendezvous"
            return [self._fallback(f"{what} did not come within {self.timeout_s:g} s")]
        out: List[object] = []
        if rec.published_at is None and now - rec.since > self.unresponsive_s:
            for uid, rank in sorted(self.plan.ranks.items(), key=lambda t: t[1]):
                if rank in rec.joined or rank in rec.dead or uid in rec.kill_sent:
                    continue
                rec.kill_sent.add(uid)
                node = self.procs[uid].node if uid in self.procs else self.rank_node(rank)
                if any(p.alive and p.node == node and u in self.plan.standby for u, p in self.procs.items()):
                    out.append(KillProcess(node, uid))
                else:   # no standby of its node to kill or watch it: it is lost to this generation
                    out.append(Note("warning", {"what": f"rank {rank} ({uid}) neither rejoined nor died within "
                                                        f"{self.unresponsive_s:g} s; no standby on {node}: "
                                                        "counted lost"}))
                    if not self._lost(rank, now, out):
                        return out
        return out + self._try_publish(now)

    def hung(self, ranks: Sequence[int], now: float) -> List[object]:
        """The supervisor's heartbeats say these ranks stopped progressing: kill them, so that
        the survivors' collectives fail and the in-process path replaces them."""
        if self.plan is None or self.fallen_back is not None or self.finished:
            return []
        out: List[object] = []
        rec = self._open(now, f"rank(s) {', '.join(map(str, ranks))} hung", out)
        for rank in ranks:
            uid = self._uid_of(rank)
            if uid is not None and uid not in rec.kill_sent:
                rec.kill_sent.add(uid)
                out.append(KillProcess(self.rank_node(rank), uid))
        return out

    def _fallback(self, reason: str) -> Fallback:
        self.fallen_back = reason
        return Fallback(reason)
