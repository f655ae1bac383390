"""Apply one drain: the fleet read, the guard, the drain, the re-read, the refusals.

Every path that drains a node on its own judgement goes through ``apply_drain``: the
health self-drain (``clusterops.health.selfdrain``), the sweep
(``clusterops.sweep.run.apply_sweep_plan``), the job supervisor (its ``DrainNodes`` action,
stragglers included). The one exception is an operator's order: ``clusterops slurm drain
NODES --reason TEXT`` (``clusterops.cli.slurmcmd``) drains exactly the nodes named, with an
``clusterops:admin:`` reason, through ``Slurm.drain`` and without the fleet guard. The decisions are
the pure functions of ``clusterops.drains``; this module only sequences the Slurm calls
of the ``slurm`` client it is given (``clusterops.slurm.Slurm`` or the pyslurm backend).

The order of a new drain:

1. read the fleet; a node drained or down with someone else's reason is kept as it is
   (``kept``); one that already carries a clusterops drain is not a new drain (``kept``,
   or ``relabelled`` when the caller may change its reason);
2. ``drains.guard_drain``: past the partition's limit the node stays in service
   (``refused``);
3. drain (Slurm refusing a user who is not a Slurm admin is ``refused`` too);
4. wait until the controller's second of the drain (``ReasonTime``) has passed, re-read
   the fleet and ask ``drains.excess_drain``: a node beyond the limit in the order (drain
   time, then name) lifts its own fresh drain, only while its reason is still exactly the
   one it wrote, and reports ``undone`` (``guard: undone`` and why, one line).

When the re-read fails, the drain is not known to be within the limit: the node lifts its
own drain as in 4 (a broken check must not drain the fleet because the controller was
slow, and the guard's refusal also leaves a failing node in service); if that fails as
well it stays drained and the outcome says so (``ok`` false). A drain that puts back what
this run lifted for a moment (``restore=True``: the sweep's recheck) is no new drain and
skips steps 2 and 4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, TYPE_CHECKING

from clusterops import drains
from clusterops.errors import ClusteropsError

if TYPE_CHECKING:   # annotations only: the Slurm layer is imported where it is used
    from clusterops.slurm.api import SlurmAPI

DRAINED, RELABELLED, KEPT, REFUSED, UNDONE, FAILED = (
    "drained", "relabelled", "kept", "refused", "undone", "failed")
# Slack for the clocks of this host and the controller when waiting past a drain's second.
DEFAULT_SETTLE_S = 1.0


@dataclass
class DrainOutcome:
    node: str
    action: str                       # one of DRAINED ... FAILED
    why: str                          # one line
    reason: str = ""                  # the reason written (drained, relabelled)
    previous_reason: Optional[str] = None
    guard: Optional[Dict[str, Any]] = None     # drains.GuardVerdict.to_dict()
    excess: Optional[Dict[str, Any]] = None    # drains.ExcessVerdict.to_dict()
    ok: bool = True
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = {"node": self.node, "action": self.action, "why": self.why, "reason": self.reason,
             "previous_reason": self.previous_reason, "ok": self.ok}
        if self.guard is not None:
            d["guard"] = self.guard
        if self.excess is not None:
            d["excess"] = self.excess
        return d


def _held(n: Any) -> bool:
    return bool(getattr(n, "drained", False)) or bool(getattr(n, "is_down", False))


def apply_drain(slurm: SlurmAPI, node: str, reason: str, guard: drains.GuardSettings, *,
                fleet: Optional[Sequence[Any]] = None, relabel: bool = False, restore: bool = False,
                settle_s: float = DEFAULT_SETTLE_S, clock: Callable[[], float] = time.time,
                sleep: Callable[[float], None] = time.sleep,
                on_stage: Optional[Callable[[str], None]] = None) -> DrainOutcome:
    """Drain ``node`` with ``reason`` under the fleet guard; see the module docstring.

    ``fleet``: Slurm's nodes as just read (saves a read); ``relabel``: an existing
    clusterops drain may get this reason; ``on_stage``: told ``drained`` once the drain is
    written (a caller bounded in time says then what it left behind)."""
    from clusterops.slurm.privilege import is_refusal

    fleet = list(fleet) if fleet is not None else slurm.nodes()
    me = next((n for n in fleet if n.name == node), None)
    if me is None:
        return DrainOutcome(node, FAILED, f"{node} is not a node Slurm knows", ok=False)
    out = DrainOutcome(node, KEPT, "", previous_reason=me.reason)
    if _held(me) and drains.is_foreign(me.reason):
        out.why = f"drained or down by someone else ({me.reason!r}): left alone"
        return out
    ours_already = _held(me) and drains.is_ours(me.reason)
    if ours_already and not restore:
        if not relabel or me.reason == reason:
            out.why = f"already carries a clusterops drain ({me.reason!r}): reason kept"
            return out
    if not restore and not ours_already:
        verdict = drains.guard_drain(node, fleet, guard)
        out.guard = verdict.to_dict()
        if not verdict.allowed:
            out.action, out.why = REFUSED, verdict.message
            return out
    try:
        slurm.drain([node], reason)
    except ClusteropsError as e:
        if is_refusal(e.message):
            out.action, out.why = REFUSED, (f"Slurm refused the drain (this user is not a Slurm admin): "
                                            f"{e.message}; node left in service")
        else:
            out.action, out.why, out.ok = FAILED, f"drain {node} failed: {e.message}", False
        return out
    out.reason = reason
    out.action = RELABELLED if ours_already and not restore else DRAINED
    out.why = "reason updated" if out.action == RELABELLED else "drained"
    if on_stage:
        on_stage(DRAINED)
    if restore:
        out.why = "drain put back"
        return out
    return _confirm(slurm, node, reason, guard, out, settle_s, clock, sleep)


def _confirm(slurm: SlurmAPI, node: str, reason: str, guard: drains.GuardSettings, out: DrainOutcome,
             settle_s: float, clock, sleep) -> DrainOutcome:
    """Step 4: re-read once the drain's second has passed; lift our own drain past the limit."""
    try:
        fleet = slurm.nodes()
        me = next((n for n in fleet if n.name == node), None)
        t = getattr(me, "reason_time", None)
        if t is not None and clock() < t + 1 + settle_s:
            # A drain made later in the same second would sort before ours by name: read
            # again once nobody can still write a drain with our reason time.
            # Never longer than one second and the slack: a controller whose clock runs
            # far ahead of this host's must not hold the node for that long.
            sleep(min(t + 1 + settle_s - clock(), 1 + settle_s))
            fleet = slurm.nodes()
    except ClusteropsError as e:
        return _undo(slurm, node, reason, out, f"guard: undone: the fleet could not be re-read after the "
                     f"drain ({e.message}), so the limit is not known to hold")
    verdict = drains.excess_drain(node, fleet, guard)
    out.excess = verdict.to_dict()
    if verdict.keep:
        return out
    me = next((n for n in fleet if n.name == node), None)
    if me is None or me.reason != reason:
        # Someone wrote another reason since: not the drain we made, not ours to lift.
        out.why = (f"over the limit, but the reason is no longer the one written "
                   f"({getattr(me, 'reason', None)!r}): left as it is")
        return out
    return _undo(slurm, node, reason, out, verdict.message)


def _undo(slurm: SlurmAPI, node: str, reason: str, out: DrainOutcome, why: str) -> DrainOutcome:
    try:
        slurm.resume([node])
    except ClusteropsError as e:
        out.why, out.ok = f"{why}; lifting its drain failed too ({e.message}): node left drained", False
        return out
    out.action, out.why = UNDONE, why
    return out
