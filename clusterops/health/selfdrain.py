"""Self-drain after a check: a pure decision, then the few Slurm calls that carry it out.

``drain_reason`` writes ``clusterops:health:<profile>: <probe>: <detail>`` for the first
failure; ``drain_decision`` (pure) says drain, resume or nothing from the report and the
node's Slurm state, following ``clusterops.drains``: only a ``fail`` drains, an
``error`` touches nothing, a passing check lifts only a drain whose cause it has just
re-checked, and a drain by someone else is never touched. ``self_drain`` asks Slurm for
the node, applies a drain through ``clusterops.drain_apply.apply_drain`` (the fleet guard
before, the re-read after: ``refused`` / ``undone``), and is bounded in time whatever the
controller does (a drain Slurm refuses because the caller is not a Slurm admin is
``refused``, like the guard's refusal); its Slurm client comes from
``clusterops.slurm.factory.connect`` with tighter limits.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, TYPE_CHECKING, Tuple

from clusterops import drains
from clusterops.health.check import first_problem

if TYPE_CHECKING:   # annotations only: the Slurm layer is imported where it is used
    from clusterops.slurm.api import SlurmAPI


def drain_reason(report: Dict[str, Any], max_len: int = drains.MAX_REASON_CHARS) -> str:
    """``clusterops:health:<profile>: <probe>: [<result>: ]<detail>`` for the first failure."""
    r = first_problem(report) or {"name": "health", "detail": report["status"]}
    probe = r.get("probe") or r["name"]
    detail = r.get("detail") or r.get("status", "")
    if r["name"] != probe:
        detail = f"{r['name']}: {detail}"
    return drains.make_reason(drains.HEALTH, probe, detail, profile=str(report["profile"]), max_chars=max_len)


def drain_decision(report: Dict[str, Any], drained: bool, down: bool,
                   current_reason: Optional[str]) -> Tuple[str, str]:
    """-> (action, why); action in drain | resume | none. Pure.

    Only a ``fail`` drains; an ``error`` touches nothing. A passing check lifts only a drain
    whose cause it has just re-checked (``drains.may_resume``). A failing check does not
    relabel a clusterops drain it could not lift itself (a supervisor's, a deeper profile's),
    and never touches someone else's. The fleet guard is applied after this, by the caller.
    """
    status = report["status"]
    profile = str(report["profile"])
    ours = drains.parse_reason(current_reason)
    foreign = drains.is_foreign(current_reason)
    held = drained or down
    if status in ("pass", "warn"):
        if held and foreign:
            return "none", f"healthy, but drained by someone else ({current_reason!r}): left alone"
        if held and ours:
            ok, why = drains.may_resume(current_reason, drains.Resumer(
                drains.BY_HEALTH, profile, drains.rechecked_probes(report["results"])))
            return ("resume", f"healthy again: {why}") if ok else ("none", f"healthy, but {why}")
        return "none", "healthy"
    if status != "fail":
        return "none", (f"check status {status}: it could not decide, so the node is left as it is "
                        "(an error never drains)")
    if held and foreign:
        return "none", f"unhealthy, already drained by someone else ({current_reason!r}): left alone"
    new_reason = drain_reason(report)
    if drained and ours:
        if current_reason == new_reason:
            return "none", "unhealthy, already drained by clusterops for this"
        mine, _ = drains.may_resume(current_reason, drains.Resumer(drains.BY_HEALTH, profile, drains.probes_ran(report["results"])))
        if not mine:
            return "none", f"unhealthy, already drained by clusterops ({ours.origin}): reason kept"
        return "drain", "unhealthy (reason updated)"
    return "drain", "unhealthy"


def self_drain(report: Dict[str, Any], node: str, *, timeout_s: float = 20.0, slurm: Optional[SlurmAPI] = None,
               guard: Optional[drains.GuardSettings] = None, settle_s: float = 1.0) -> Dict[str, Any]:
    """Drain or resume ``node`` after a check; bounded by ``timeout_s`` whatever the controller does.

    A drain goes through ``clusterops.drain_apply.apply_drain``: the fleet guard first
    (past ``guard.max_drained_fraction`` of the partition the node stays in service: action
    ``refused``), then, after the drain, the re-read that lets the nodes beyond the limit
    lift their own fresh drain when many drained at once (action ``undone``)."""
    box: Dict[str, Any] = {"node": node, "action": "none", "why": "", "ok": False}
    guard = guard or drains.GuardSettings()
    stage = {"at": "asking"}

    if report["status"] not in ("pass", "warn", "fail"):
        # An error decides nothing: Slurm is not even asked.
        action, why = drain_decision(report, False, False, None)
        box.update(action=action, why=why, ok=True)
        return box

    def work():
        from clusterops import drain_apply as da
        from clusterops.slurm.factory import connect

        # Each call bounded well inside timeout_s, so the whole stays inside it.
        s = slurm or connect(timeout_s=max(2.0, timeout_s / 3), read_attempts=2, backoff_s=0.5)
        # This node only: a passing check on every node of a big fleet must not make every
        # node read the whole fleet. The fleet is read only for a drain (apply_drain).
        info = s.node(node)
        action, why = drain_decision(report, info.drained, info.is_down, info.reason or None)
        box.update(action=action, why=why, previous_reason=info.reason)
        if action == "drain":
            out = da.apply_drain(s, node, drain_reason(report), guard, relabel=True,
                                 settle_s=settle_s, on_stage=lambda at: stage.update(at=at))
            action = {da.DRAINED: "drain", da.RELABELLED: "drain", da.REFUSED: "refused",
                      da.UNDONE: "undone"}.get(out.action, "none")
            box.update(action=action, why=why if out.action in (da.DRAINED, da.RELABELLED) else out.why,
                       ok=out.ok)
            for k in ("guard", "excess"):
                if getattr(out, k) is not None:
                    box[k] = getattr(out, k)
            if out.reason:
                box["reason"] = out.reason
            return
        elif action == "resume":
            s.resume([node])
        box["ok"] = True

    def run():
        try:
            work()
        except Exception as e:  # controller down, node unknown...: report, never hang or crash
            box.update(action="none", why=f"Slurm not reachable or refused: {e}", ok=False)

    th = threading.Thread(target=run, daemon=True, name="self-drain")
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        if stage["at"] == "drained":
            box.update(action="drain", ok=False, why=(
                f"drained, but the fleet guard's re-read did not finish within {timeout_s:g}s: "
                "node left drained, maybe beyond the limit"))
        else:
            box.update(action="none", why=f"Slurm did not answer within {timeout_s:g}s; node left as it was",
                       ok=False)
    return box
