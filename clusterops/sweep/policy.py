"""The sweep's drain policy, as pure functions: no Slurm, no clock, no side effects.

``plan_drains`` takes node states from Slurm (:class:`NodeSnapshot`), this sweep's
results and each node's recent history, and returns a :class:`DrainPlan`: drains,
resumes, relabels and nodes left alone, each with its reason. The rules: a failing
node is drained (``clusterops:sweep:``), one failing ``flap_k`` of the last ``flap_n``
sweeps is drained as flapping (``clusterops:flapping:``), a straggler only with
``drain_stragglers`` (``clusterops:straggler:``); a node drained or downed by someone
else is never touched; a clusterops drain is lifted only when ``clusterops.drains``
(the ownership and resume rule, with the reason format) says this sweep may lift it.
The safety guard (``allowed_drains``) refuses every new drain when more than
``max_drain_fraction`` of the swept nodes would go. ``run.apply_sweep_plan`` carries a
plan out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Mapping, Optional, Sequence

from clusterops import drains
from clusterops.errors import InputError
from clusterops.sweep.results import NodeResult, natural_key


@dataclass(frozen=True)
class NodeSnapshot:
    """What the policy needs to know about a node's Slurm state."""
    name: str
    drained: bool = False
    down: bool = False
    busy: bool = False
    reason: Optional[str] = None

    @property
    def ours(self) -> bool:
        return drains.is_ours(self.reason)

    @classmethod
    def from_info(cls, info) -> "NodeSnapshot":
        return cls(info.name, drained=info.drained, down=info.is_down, busy=info.busy, reason=info.reason)


@dataclass
class Action:
    node: str
    action: str          # drain | resume | keep | untouched
    why: str
    reason: str = ""     # the Slurm reason a drain writes

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DrainPlan:
    actions: List[Action]
    swept: int
    allowed: int
    guard_tripped: bool = False
    message: str = ""

    def of(self, kind: str) -> List[Action]:
        return [a for a in self.actions if a.action == kind]

    @property
    def drains(self) -> List[Action]:
        return self.of("drain")

    @property
    def resumes(self) -> List[Action]:
        return self.of("resume")

    def to_dict(self) -> dict:
        return {"swept": self.swept, "allowed_drains": self.allowed, "guard_tripped": self.guard_tripped,
                "message": self.message, "actions": [a.to_dict() for a in self.actions]}


def drain_reason(probe: str, detail: str, origin: str = drains.SWEEP) -> str:
    """``clusterops:<origin>: <probe>: <detail>``; origin sweep, straggler or flapping."""
    return drains.make_reason(origin, probe or "check", detail or "failed")


def allowed_drains(swept: int, max_drain_fraction: float) -> int:
    """How many new drains one sweep may make: floor(fraction x swept), at least one
    unless the fraction is 0 (one bad node in a small pool must still be drainable)."""
    if max_drain_fraction <= 0 or swept <= 0:
        return 0
    return max(1, int(max_drain_fraction * swept + 1e-9))


def plan_drains(nodes: Mapping[str, NodeSnapshot], results: Mapping[str, NodeResult],
                fail_history: Mapping[str, Sequence[bool]], *, max_drain_fraction: float = 0.1,
                flap_k: int = 3, flap_n: int = 5, drain_stragglers: bool = False) -> DrainPlan:
    """Decide drains and resumes. Pure: no Slurm, no clock.

    ``fail_history[node]``: for the node's previous checked sweeps, newest first,
    whether each one failed. Today's result counts as the newest of the ``flap_n``.
    """
    if not 0 <= max_drain_fraction <= 1:
        raise InputError(f"--max-drain-fraction: must be between 0 and 1, got {max_drain_fraction}")
    if not 1 <= flap_k <= flap_n:
        raise InputError(f"--flap-k/--flap-n: need 1 <= k <= n, got k={flap_k} n={flap_n}")
    actions: List[Action] = []
    swept = sum(1 for r in results.values() if r.checked)
    for name in sorted(results, key=natural_key):
        r = results[name]
        snap = nodes.get(name)
        if snap is None:
            actions.append(Action(name, "untouched", "not a Slurm node"))
            continue
        if snap.reason and not snap.ours and (snap.drained or snap.down):
            actions.append(Action(name, "untouched", f"drained/down by someone else: {snap.reason}"))
            continue
        if not r.checked:
            actions.append(Action(name, "untouched", f"{r.status}: {r.detail}".rstrip(": ")))
            continue
        ours_drained = snap.drained and snap.ours
        if ours_drained:
            # Still failing: the reason changes hands only when this sweep could lift the old
            # drain itself; a deeper check's, or an administrator's, keeps its owner.
            relabel, _ = drains.may_resume(snap.reason, drains.Resumer(
                drains.BY_SWEEP, r.profile or None, drains.probes_ran(r.probes)))
        failed_before = list(fail_history.get(name, ()))[: flap_n - 1]
        fails = sum(1 for f in [r.failing] + failed_before if f)
        straggling = drain_stragglers and bool(r.stragglers)
        if r.failing or straggling:
            if r.failing:
                reason = drain_reason(r.probe or r.status, r.detail)
            else:
                reason = drain_reason(", ".join(r.stragglers), "below the fleet median", drains.STRAGGLER)
            if ours_drained:
                actions.append(Action(name, "keep", "still failing", reason if relabel else snap.reason or ""))
            else:
                actions.append(Action(name, "drain", f"{r.status}: {r.detail}".rstrip(": "), reason))
        elif fails >= flap_k:
            reason = drain_reason(f"{fails}/{flap_n}", f"failed {fails} of the last {flap_n} sweeps",
                                  drains.FLAPPING)
            if ours_drained:
                actions.append(Action(name, "keep", f"passes today but flapping ({fails}/{flap_n})",
                                      reason if relabel else snap.reason or ""))
            else:
                actions.append(Action(name, "drain", f"flapping: failed {fails} of the last {flap_n} sweeps",
                                      reason))
        elif ours_drained:
            ok, why = drains.may_resume(snap.reason, drains.Resumer(
                drains.BY_SWEEP, r.profile or None, drains.rechecked_probes(r.probes), flap_clean=True))
            if ok:
                actions.append(Action(name, "resume", f"passes now (was: {snap.reason})"))
            else:
                actions.append(Action(name, "keep", f"passes, but {why}", snap.reason or ""))
        else:
            actions.append(Action(name, "untouched", r.status))
    allowed = allowed_drains(swept, max_drain_fraction)
    plan = DrainPlan(actions, swept, allowed)
    new = plan.drains
    if len(new) > allowed:
        plan.guard_tripped = True
        plan.message = (f"SAFETY GUARD: {len(new)} of {swept} swept nodes would be drained, more than "
                        f"--max-drain-fraction {max_drain_fraction:g} allows ({allowed}); draining NONE. "
                        f"A broken check must not empty the cluster: look at the failures, then rerun "
                        f"with a higher --max-drain-fraction if they are real.")
        for a in new:
            a.action = "untouched"
            a.why = f"guard: would drain ({a.why})"
    return plan
