"""Who drains a node, who may lift the drain, and how many drains a partition can take.

Pure functions only: plain values in, a decision out (the Slurm calls stay in
``clusterops.slurm``, ``health.self_drain``, the sweep and the supervisor plumbing).

**Reasons.** Every drain clusterops writes carries its origin::

    clusterops:health:<profile>: <probe>: <detail>     a health check with --drain-on-fail
    clusterops:sweep: <probe>: <detail>                a fleet sweep found the node failing
    clusterops:straggler: <metrics>: <detail>          a sweep found it far below the fleet median
    clusterops:flapping: <k>/<n>: <detail>             a sweep saw it fail k of its last n sweeps
    clusterops:supervisor: <why>: <detail>             a training job's supervisor judged it bad
    clusterops:admin: <detail>                         someone ran `clusterops slurm drain`
    clusterops:quarantine: <node|GPU uuid>: <detail>   blamed K times in a window (clusterops.quarantine)
    clusterops:sdc: <ranks>: <detail>                  a job's replicas disagreed and this node's differed

Reasons written before origins existed (``clusterops: <probe>: <detail>``) are still
ours; they read as origin ``legacy``. Anything else is foreign and never resumed.

**Who may resume what** (``may_resume``):

- a passing health check lifts a ``health`` drain only when it has just re-checked the
  cause: it ran the probe named in the reason, that probe passed, and its profile is at
  least as deep as the one that drained (fast < preflight < deep; a profile of another
  name counts only for itself). A ``legacy`` drain is lifted the same way when its first
  field names a probe the check ran and passed (its depth is unknown). Drains of every
  other origin wait for a sweep or an administrator.
- a sweep in which the node passes lifts ``sweep``, ``straggler``, ``supervisor`` and
  ``legacy`` drains; ``flapping`` ones only once the node's k-of-n window is clean; and
  ``health`` drains under the same re-checked rule as a health check (a fast sweep does
  not undo a deep drain).
- an ``sdc`` drain (the supervisor's replica check named the node) is lifted only by a
  check or sweep that ran the ``sdc`` probe and passed it (``deep`` has it): a fast
  profile does not see silent data corruption, so it does not undo the drain.
- a ``quarantine`` drain is lifted by no check and no sweep: only by a person
  (``clusterops health quarantine clear``, which also clears the blames; ``clusterops
  slurm resume`` lifts it too, but leaves the blames counting).
- an administrator (``clusterops slurm resume``) lifts any clusterops drain.
- nobody lifts a foreign reason: ``Slurm.resume`` itself raises for one.

**The fleet guard** (``guard_drain``): a new drain is refused when the node's partition
would then carry more clusterops drains than ``max_drained_fraction`` of its nodes allows
(floor of fraction x nodes, but at least one unless the fraction is 0 -- one bad node in
a small partition must still be drainable). A node that already carries a clusterops
drain is not a new drain.

**The guard under concurrency** (``excess_drain``, applied by
``clusterops.drain_apply.apply_drain``): twenty nodes that fail at the same second all
read a healthy fleet before any of them drains, so a check before the drain cannot hold
the limit alone. Each drainer therefore drains, waits until its drain's second
(``ReasonTime``) has passed, re-reads the fleet and orders every clusterops drain in the
partition by (reason time, node name): drains made before the storm come first. A node
whose place in that order is beyond the limit lifts its own fresh drain (only while the
reason is still exactly the one it wrote) and reports ``guard: undone``. Every drain that
stays was, at its re-read, within the first ``limit`` of an order that later drains only
extend at the end, so at most ``limit`` stay, with no lock server.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import (Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Protocol, Sequence,
                    Tuple)

from clusterops.errors import InputError

PREFIX = "clusterops:"
HEALTH, SWEEP, STRAGGLER, FLAPPING, SUPERVISOR, ADMIN, QUARANTINE, SDC, LEGACY = (
    "health", "sweep", "straggler", "flapping", "supervisor", "admin", "quarantine", "sdc", "legacy")
ORIGINS = (HEALTH, SWEEP, STRAGGLER, FLAPPING, SUPERVISOR, ADMIN, QUARANTINE, SDC)
# Who asks to lift a drain.
BY_HEALTH, BY_SWEEP, BY_ADMIN = "health", "sweep", "admin"
# Built-in profiles by depth: a check lifts only drains of a profile no deeper than its own.
PROFILE_DEPTH = {"fast": 0, "preflight": 1, "deep": 2}
MAX_REASON_CHARS = 200

DEFAULT_MAX_DRAINED_FRACTION = 0.1
FRACTION_ENV = "CLUSTEROPS_MAX_DRAINED_FRACTION"
DRAIN_KEYS = ("max_drained_fraction", "partition")

_HEALTHY = ("pass", "warn")
_NEW = re.compile(r"^clusterops:(?P<origin>[a-z]+)(?::(?P<profile>[^\s:]+))?:(?:\s(?P<rest>.*))?$")
_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_.+-]")


# -- reasons --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reason:
    """A parsed clusterops drain reason."""

    origin: str                    # one of ORIGINS, or "legacy"
    probe: str = ""                # health/sweep: the probe; other origins: the first field
    detail: str = ""
    profile: Optional[str] = None  # health drains: the profile that drained
    text: str = ""


def _one_line(text: object) -> str:
    return " ".join(str(text or "").split())


def _token(text: str) -> str:
    """A profile name as one reason field: no spaces or colons (a file stem may hold any)."""
    return _TOKEN_BAD.sub("_", text) or "profile"


def make_reason(origin: str, probe: str, detail: str = "", *, profile: Optional[str] = None,
                max_chars: int = MAX_REASON_CHARS) -> str:
    """``clusterops:<origin>[:<profile>]: <probe>: <detail>`` on one line, at most ``max_chars``."""
    if origin not in ORIGINS:
        raise ValueError(f"unknown drain origin {origin!r}; known: {', '.join(ORIGINS)}")
    if (origin == HEALTH) != (profile is not None):
        raise ValueError("a health drain names its profile, and only a health drain does")
    head = PREFIX + origin + (f":{_token(profile)}" if profile is not None else "") + ":"
    fields = [f for f in (_one_line(probe), _one_line(detail)) if f]
    text = head + (" " + ": ".join(fields) if fields else "")
    if text.endswith('"'):
        # scontrol update drops a reason's last character when it is a double quote
        # (seen on 22.05): end with something it keeps, so the reason reads back as written.
        text += "."
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def parse_reason(text: Optional[str]) -> Optional[Reason]:
    """The reason as clusterops wrote it, or None when it is not ours (or empty)."""
    if not text or not text.startswith(PREFIX):
        return None
    m = _NEW.match(text)
    if m and m.group("origin") in ORIGINS and (m.group("profile") is None) == (m.group("origin") != HEALTH):
        rest = m.group("rest") or ""
        probe, _, detail = rest.partition(": ")
        return Reason(m.group("origin"), probe.strip(), detail.strip(), m.group("profile"), text)
    # Before origins: "clusterops: <probe>: <detail>" (or anything else after the prefix).
    rest = text[len(PREFIX):].strip()
    probe, _, detail = rest.partition(": ")
    return Reason(LEGACY, probe.strip(), detail.strip(), None, text)


def is_ours(reason: Optional[str]) -> bool:
    return parse_reason(reason) is not None


def is_foreign(reason: Optional[str]) -> bool:
    """A reason someone else wrote (an empty reason belongs to nobody)."""
    return bool(reason) and not is_ours(reason)


# -- who may resume what ---------------------------------------------------------------------

def rechecked_probes(results: Iterable[Mapping[str, Any]]) -> FrozenSet[str]:
    """Names a check re-checked and found healthy: each probe (the ``probe`` key of a result)
    and each result name whose results were all pass/warn/skip with at least one pass/warn.
    A probe that only skipped checked nothing."""
    seen: Dict[str, List[str]] = {}
    for r in results:
        status = str(r.get("status", "error"))
        for key in {r.get("name"), r.get("probe")}:
            if key:
                seen.setdefault(str(key), []).append(status)
    return frozenset(k for k, sts in seen.items()
                     if all(s in _HEALTHY + ("skip",) for s in sts) and any(s in _HEALTHY for s in sts))


def probes_ran(results: Iterable[Mapping[str, Any]]) -> FrozenSet[str]:
    """Probe and result names a check ran, whatever they found (a skip is not a run)."""
    return frozenset(str(k) for r in results if r.get("status") != "skip"
                     for k in (r.get("name"), r.get("probe")) if k)


def deep_enough(checker_profile: Optional[str], drain_profile: Optional[str]) -> bool:
    """Is a check of ``checker_profile`` at least as deep as the one that drained?"""
    if not checker_profile or not drain_profile:
        return False
    checker, drained = _token(checker_profile), _token(drain_profile)
    if checker == drained:
        return True
    if checker in PROFILE_DEPTH and drained in PROFILE_DEPTH:
        return PROFILE_DEPTH[checker] >= PROFILE_DEPTH[drained]
    return False


@dataclass(frozen=True)
class Resumer:
    """Who asks to lift a drain, and what it has just seen."""

    kind: str                                  # BY_HEALTH | BY_SWEEP | BY_ADMIN
    profile: Optional[str] = None              # the profile of the passing check
    rechecked: FrozenSet[str] = frozenset()    # rechecked_probes() of that check
    flap_clean: bool = True                    # sweep: the node's k-of-n window is clean


def may_resume(reason: Optional[str], who: Resumer) -> Tuple[bool, str]:
    """-> (may lift the drain, why). The one written rule; see the module docstring."""
    r = parse_reason(reason)
    if r is None:
        if reason:
            return False, f"drained by someone else ({reason!r}): never resumed by clusterops"
        return False, "no clusterops drain to lift"
    if who.kind == BY_ADMIN:
        return True, f"an administrator lifts the {r.origin} drain"
    if r.origin == QUARANTINE:
        return False, "quarantined (repeat offender): only `clusterops health quarantine clear` lifts it"
    if r.origin == SDC:
        if who.kind in (BY_HEALTH, BY_SWEEP) and "sdc" in who.rechecked:
            return True, "the sdc probe re-checked it and passes"
        return False, "sdc drain: waits for a check or sweep that runs the sdc probe (profile deep), or an administrator"
    if r.origin in (HEALTH, LEGACY) and who.kind in (BY_HEALTH, BY_SWEEP):
        if r.origin == LEGACY and who.kind == BY_SWEEP:
            return True, "passes the sweep (drain from before origins)"
        if r.probe not in who.rechecked:
            by = f" (profile {r.profile})" if r.profile else ""
            return False, (f"{r.origin} drain{by} for {r.probe or 'an unnamed probe'} not re-checked by "
                           f"profile {who.profile}: left drained")
        if r.origin == HEALTH and not deep_enough(who.profile, r.profile):
            return False, (f"drained by the {r.profile} profile; profile {who.profile} is not as deep: "
                           "left drained")
        return True, f"{r.probe} re-checked by profile {who.profile} and passes"
    if who.kind == BY_SWEEP:
        if r.origin == FLAPPING and not who.flap_clean:
            return False, "still flapping: waits until its window of sweeps is clean"
        if r.origin == ADMIN:
            return False, "drained through `clusterops slurm drain`: waits for an administrator"
        return True, f"passes the sweep ({r.origin} drain)"
    return False, f"{r.origin} drain: waits for a sweep or an administrator"


# -- the fleet guard ----------------------------------------------------------------------------

class NodeLike(Protocol):
    name: str
    partitions: Sequence[str]
    reason: Optional[str]

    @property
    def drained(self) -> bool: ...


@dataclass(frozen=True)
class GuardSettings:
    max_drained_fraction: float = DEFAULT_MAX_DRAINED_FRACTION
    partition: Optional[str] = None      # None: the node's own partitions, from Slurm


@dataclass(frozen=True)
class GuardVerdict:
    allowed: bool
    message: str                      # one line
    partition: Optional[str] = None   # the partition that decided (the refusing one, if any)
    drained: int = 0                  # nodes there already carrying a clusterops drain (not this one)
    total: int = 0
    limit: int = 0

    def to_dict(self) -> dict:
        return {"allowed": self.allowed, "message": self.message, "partition": self.partition,
                "drained": self.drained, "total": self.total, "limit": self.limit}


def drain_limit(total: int, fraction: float) -> int:
    """How many nodes of ``total`` may carry a clusterops drain at once."""
    if fraction <= 0 or total <= 0:
        return 0
    return max(1, int(fraction * total + 1e-9))


def _carries_our_drain(n: Any) -> bool:
    down = getattr(n, "is_down", False)
    return (bool(getattr(n, "drained", False)) or bool(down)) and is_ours(getattr(n, "reason", None))


def guard_drain(node: str, fleet: Sequence[Any], settings: GuardSettings) -> GuardVerdict:
    """May clusterops drain ``node`` now? ``fleet``: the nodes Slurm knows (``NodeInfo``-like:
    name, partitions, drained, is_down, reason). Pure."""
    frac = settings.max_drained_fraction
    me = next((n for n in fleet if n.name == node), None)
    if me is not None and _carries_our_drain(me):
        return GuardVerdict(True, f"{node} already carries a clusterops drain: not a new drain")
    if settings.partition:
        parts: List[Optional[str]] = [settings.partition]
    else:
        parts = list(getattr(me, "partitions", ()) or ()) or [None]
    checked: Optional[GuardVerdict] = None
    for part in parts:
        members = [n for n in fleet if part is None or part in (getattr(n, "partitions", ()) or ())]
        if not any(n.name == node for n in members):
            members = members + ([me] if me is not None else [])
        total = max(len(members), 1)
        drained = sum(1 for n in members if n.name != node and _carries_our_drain(n))
        limit = drain_limit(total, frac)
        where = f"partition {part}" if part else "the cluster"
        if drained + 1 > limit:
            return GuardVerdict(False, (
                f"fleet guard: NOT draining {node}: {drained} of {total} nodes of {where} already carry a "
                f"clusterops drain and max_drained_fraction {frac:g} allows {limit}; a check failing "
                f"everywhere is more likely broken than the nodes: look, then drain by hand or raise "
                f"drain.max_drained_fraction"), part, drained, total, limit)
        checked = GuardVerdict(True, f"{drained + 1} of {total} nodes of {where} drained by clusterops "
                                     f"(limit {limit})", part, drained, total, limit)
    return checked or GuardVerdict(True, "no partition to guard")


def guard_settings(site: Optional[Mapping[str, Any]] = None, site_path: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None) -> GuardSettings:
    """The guard's settings: the site config's ``drain:`` mapping, then the environment
    (``CLUSTEROPS_MAX_DRAINED_FRACTION`` wins). Bad values -> InputError (exit 2)."""
    env = os.environ if env is None else env
    src = site_path or "site config"
    block = (site or {}).get("drain")
    frac: Any = DEFAULT_MAX_DRAINED_FRACTION
    partition: Optional[str] = None
    if block is not None:
        if not isinstance(block, Mapping):
            raise InputError(f"{src}: drain: must be a mapping with {', '.join(DRAIN_KEYS)}")
        for k in block:
            if k not in DRAIN_KEYS:
                raise InputError(f"{src}: drain.{k}: unknown key; valid: {', '.join(DRAIN_KEYS)}")
        if "max_drained_fraction" in block:
            frac = _fraction(block["max_drained_fraction"], f"{src}: drain.max_drained_fraction")
        p = block.get("partition")
        if p is not None:
            if not isinstance(p, str) or not p.strip() or any(c.isspace() for c in p):
                raise InputError(f"{src}: drain.partition: must be a partition name")
            partition = p
    if env.get(FRACTION_ENV, "").strip():
        frac = _fraction(env[FRACTION_ENV].strip(), f"${FRACTION_ENV}")
    return GuardSettings(float(frac), partition)


def _fraction(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise InputError(f"{what}: must be a number between 0 and 1, got {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{what}: must be a number between 0 and 1, got {value!r}") from None
    if not 0 <= f <= 1:
        raise InputError(f"{what}: must be between 0 and 1, got {value!r}")
    return f


def _drain_key(n: Any) -> Tuple[float, str]:
    t = getattr(n, "reason_time", None)
    return (float(t) if t is not None else float("inf"), str(n.name))


@dataclass(frozen=True)
class ExcessVerdict:
    """What a node that has just drained learns from the re-read fleet."""

    keep: bool
    message: str                      # one line
    partition: Optional[str] = None
    rank: int = 0                     # 1-based place of this node's drain in the order
    drained: int = 0                  # clusterops drains in that partition, this one included
    limit: int = 0
    ahead: Tuple[str, ...] = ()       # the drains ordered before this one (the limit's holders)

    def to_dict(self) -> dict:
        return {"keep": self.keep, "message": self.message, "partition": self.partition, "rank": self.rank,
                "drained": self.drained, "limit": self.limit, "ahead": list(self.ahead)}


def excess_drain(node: str, fleet: Sequence[Any], settings: GuardSettings) -> ExcessVerdict:
    """After ``node`` drained: is its drain within the limit of every partition it guards?

    ``fleet`` is re-read after the drain (``reason_time`` known). The clusterops drains of a
    partition are ordered by (reason time, name); ``node`` keeps its drain only when its
    place is within ``drain_limit`` everywhere. Pure."""
    frac = settings.max_drained_fraction
    me = next((n for n in fleet if n.name == node), None)
    if me is None or not _carries_our_drain(me):
        return ExcessVerdict(True, f"{node} carries no clusterops drain now: nothing to weigh")
    parts: List[Optional[str]] = ([settings.partition] if settings.partition
                                  else list(getattr(me, "partitions", ()) or ()) or [None])
    kept: Optional[ExcessVerdict] = None
    for part in parts:
        members = [n for n in fleet if part is None or part in (getattr(n, "partitions", ()) or ())]
        if not any(n.name == node for n in members):
            members.append(me)
        ours = sorted((n for n in members if _carries_our_drain(n)), key=_drain_key)
        limit = drain_limit(len(members), frac)
        rank = 1 + next(i for i, n in enumerate(ours) if n.name == node)
        where = f"partition {part}" if part else "the cluster"
        ahead = tuple(n.name for n in ours[: rank - 1])
        if rank > limit:
            return ExcessVerdict(False, (
                f"guard: undone: {node} drained at the same time as others; {len(ours)} of {len(members)} "
                f"nodes of {where} now carry a clusterops drain, max_drained_fraction {frac:g} allows "
                f"{limit}, and {node} is number {rank} by drain time then name: its own drain lifted, "
                f"node left in service"), part, rank, len(ours), limit, ahead)
        kept = ExcessVerdict(True, f"{node} is drain {rank} of {len(ours)} in {where} (limit {limit})",
                             part, rank, len(ours), limit, ahead)
    return kept or ExcessVerdict(True, "no partition to guard")
