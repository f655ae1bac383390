"""The stability guard: loss spikes and non-finite values found, and what to do about them.

Pure, in the supervisor's style: samples go in, findings and decisions come out; nothing
here reads a clock, a file or a process. :class:`clusterops.supervisor.Supervisor` owns one
:class:`Guard` per job (``supervise: {stability: {...}}``), feeds it the ranks' loss and
grad norm from the heartbeats (:meth:`Guard.feed`) and turns its :class:`Decision` into
records, a kill and a relaunch.

Detection (:class:`Detector`, one per job, carried across restarts):

- **Non-finite** loss or grad norm on any rank is a finding at once (``nan``).
- **Spike**: a sample whose value is above the robust band of the in-band samples,
  ``centre + factor * max(1.4826 * MAD, MIN_REL_BAND * |centre|)`` -- the centre is the
  median of the newest ``min_samples`` samples, the MAD that of the consecutive differences
  over the last ``window`` samples (divided by sqrt 2: the noise of one sample, which a
  falling trend does not inflate) -- for ``patience`` samples in a row (``loss_spike``). Only upward moves count (a falling
  loss is the point of training); samples out of the band never enter the window, so a
  spike does not widen the band that judges it.
- **Warm-up**: before ``warmup_steps`` and until ``min_samples`` samples are in the
  window, only non-finite values are findings.
- **After a resume**: the samples of steps after the resume point belong to a timeline
  that was thrown away; they are dropped (:meth:`Detector.resumed`), and the band of the
  steps before it judges the new attempt from its first sample (so a spike that comes
  back right after a rollback is seen), after ``resume_grace_steps`` steps in which only
  non-finite values count (the first steps after a restart are noisier).

Deciding (:meth:`Guard.decide`): ``record`` changes nothing; ``stop`` ends the job with
:attr:`~clusterops.exitcodes.Supervise.DIVERGED`, not saving the bad state; ``rollback``
kills the step (no save of the bad state) and relaunches from the newest checkpoint at
least ``rollback_steps`` before the anomaly began, with a :class:`ResumeHint` (skip
``skip_batches`` batches, or more so the skip passes the anomaly (:func:`skip_for`),
multiply the learning rate by ``lr_factor``) that the SDK hands
to the script (``sdk.resume().hint``). More than ``max_rollbacks`` rollbacks whose
anomalies began within ``rollback_window_steps`` steps of each other end the job with
:attr:`~clusterops.exitcodes.Supervise.ROLLBACK_BUDGET`.

The guard's list of checkpoints is what it was told, not what is on disk now: retention may
have pruned the target since, or it may no longer verify. So a rollback's target is a plan
(:attr:`Decision.before` is the newest step the rule allows) until the disk has been looked
at; :meth:`Guard.retarget` then takes the checkpoint found there (the newest at or before
``before`` that exists and verifies), or turns the rollback into a give-up when there is none.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops import schema
from clusterops.protocol import ResumeHint

#: The band's floor, relative to the median: with a flat, quiet curve (MAD near 0) an
#: ordinary wiggle must not read as a spike.
MIN_REL_BAND = 0.02
#: MAD -> standard deviation for normally distributed noise.
MAD_TO_SIGMA = 1.4826


class Action(str, Enum):
    """What the guard does about a finding (``on_spike`` / ``on_nan``)."""

    RECORD = "record"
    STOP = "stop"
    ROLLBACK = "rollback"
    REPLAY = "replay"            # rerun the anomalous steps on other nodes first: data or hardware?

    def __str__(self) -> str:
        return self.value


class Kind(str, Enum):
    """What was found (the timeline record's ``event``)."""

    SPIKE = "loss_spike"
    NAN = "nan"
    SDC = "sdc_suspect"        # replicas that disagree (clusterops.replicas), decided by decide_sdc

    def __str__(self) -> str:
        return self.value


@schema.dataclass_of(schema.STABILITY_FIELDS, frozen=True)
class StabilityConfig:
    """``supervise: {stability: {...}}``: the fields, defaults and bounds are
    ``clusterops.schema.STABILITY_FIELDS`` (the docs table is generated from them)."""

    @classmethod
    def from_mapping(cls, d: Mapping[str, object]) -> "StabilityConfig":
        """From the validated ``stability`` mapping (unknown keys are the schema's job)."""
        names = {f.name for f in schema.STABILITY_FIELDS}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


@dataclass(frozen=True)
class Sample:
    """One look at the ranks: the lowest step among them and the median of their values
    (None: no rank reports it); ``nonfinite`` names the ranks whose value is NaN or inf."""

    step: int
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    nonfinite: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Finding:
    kind: Kind
    step: int                       # the sample that made it a finding
    began: int                      # the first step that may hold the anomaly
    signal: str                     # "loss" | "grad_norm"
    value: float
    band: Tuple[Optional[float], Optional[float]] = (None, None)   # (median, upper limit)
    ranks: Tuple[int, ...] = ()     # non-finite on these ranks

    def record(self) -> dict:
        return {"step": self.step, "began": self.began, "signal": self.signal, "value": _json_num(self.value),
                "median": _json_num(self.band[0]), "limit": _json_num(self.band[1]), "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Decision:
    action: str                     # Action, or "give_up"
    finding: Finding
    hint: Optional[ResumeHint] = None   # rollback: where to and what to skip
    why: str = ""
    hold: Optional[int] = None          # the checkpoint retention must keep: the newest before the anomaly
    before: Optional[int] = None        # rollback: the newest step its checkpoint may have (the rule's bound)

    GIVE_UP = "give_up"


def _json_num(x: Optional[float]):
    if x is None:
        return None
    return x if math.isfinite(x) else str(x)


def finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(x)


class _Band:
    """A rolling window of one signal's in-band samples: (step, value)."""

    def __init__(self, size: int):
        self.values: Deque[Tuple[int, float]] = deque(maxlen=size)
        self.streak_from: Optional[int] = None   # the step after the last in-band sample, while out
        self.streak = 0
        self.last_in: Optional[int] = None       # step of the last in-band sample

    def limits(self, recent: int) -> Tuple[float, float]:
        """(centre, scale): the median of the ``recent`` newest samples (a falling curve's
        median over the whole window lags far above it), and the noise from the whole window
        as the MAD of consecutive differences / sqrt 2 (a trend does not inflate it), at
        least MIN_REL_BAND of the centre."""
        vals = [v for _, v in self.values]
        med = statistics.median(vals[-recent:])
        diffs = [b - a for a, b in zip(vals, vals[1:])] or [0.0]
        dmed = statistics.median(diffs)
        mad = statistics.median(abs(d - dmed) for d in diffs) / math.sqrt(2)
        return med, max(MAD_TO_SIGMA * mad, MIN_REL_BAND * abs(med), 1e-12)

    def drop_after(self, step: int) -> None:
        kept = [(s, v) for s, v in self.values if s <= step]
        self.values.clear()
        self.values.extend(kept)
        self.streak, self.streak_from = 0, None
        self.last_in = kept[-1][0] if kept else None


class Detector:
    """Finds spikes and non-finite values in the samples of one job (see the module)."""

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.bands: Dict[str, _Band] = {"loss": _Band(cfg.window), "grad_norm": _Band(cfg.window)}
        self.last_step: Optional[int] = None
        self.grace_until = -1

    def resumed(self, step: Optional[int]) -> None:
        """A new attempt continues from checkpoint ``step`` (None: from the start)."""
        at = -1 if step is None else step
        for b in self.bands.values():
            b.drop_after(at)
        self.last_step = step
        self.grace_until = at + self.cfg.resume_grace_steps

    def feed(self, s: Sample) -> Optional[Finding]:
        """One sample (a step not seen before); the finding it completes, if any."""
        if self.last_step is not None and s.step <= self.last_step:
            return None
        prev, self.last_step = self.last_step, s.step
        signals = [("loss", s.loss)] + ([("grad_norm", s.grad_norm)] if self.cfg.watch_grad_norm else [])
        for name, value in signals:
            if value is not None and not math.isfinite(value):
                b = self.bands[name]
                began = b.streak_from if b.streak_from is not None else (prev + 1 if prev is not None else s.step)
                return Finding(Kind.NAN, s.step, began, name, value, ranks=tuple(s.nonfinite))
        found = None
        for name, value in signals:
            if value is None:
                continue
            f = self._judge(name, value, s.step, prev)
            found = found or f
        return found

    def _judge(self, name: str, value: float, step: int, prev: Optional[int]) -> Optional[Finding]:
        b, c = self.bands[name], self.cfg
        judged = step >= c.warmup_steps and step > self.grace_until and len(b.values) >= c.min_samples
        if judged:
            med, scale = b.limits(c.min_samples)
            limit = med + c.factor * scale
            if value > limit:
                if b.streak == 0:
                    b.streak_from = (b.last_in + 1) if b.last_in is not None else (prev + 1 if prev is not None
                                                                                   else step)
                b.streak += 1
                if b.streak >= c.patience:
                    return Finding(Kind.SPIKE, step, b.streak_from, name, value, band=(med, limit))
                return None
        b.streak, b.streak_from = 0, None
        b.values.append((step, value))
        b.last_in = step
        return None


def sample_of(signals: Mapping[int, Tuple[int, Optional[float], Optional[float]]]) -> Optional[Sample]:
    """One :class:`Sample` from rank -> (step, loss, grad norm) of each rank's latest beat
    (None: not reported): the lowest step, the median of the finite values, and the ranks
    with a non-finite one (whose value then stands for the sample). A non-finite sample
    takes its step from the beats that carry the non-finite value, not from a rank whose
    latest beat is older: under load a node's beat lags by seconds, and a NaN seen at step 76
    must not be reported at 73 (a replay to "73 + margin" would stop before it)."""
    if not signals:
        return None
    bad = tuple(sorted(r for r, (_, lo, g) in signals.items() if not finite(lo) or not finite(g)))
    steps = [signals[r][0] for r in bad] if bad else [v[0] for v in signals.values()]

    def pick(i: int) -> Optional[float]:
        vals = [v[i] for v in signals.values() if v[i] is not None]
        if not vals:
            return None
        odd = [x for x in vals if not math.isfinite(x)]
        return odd[0] if odd else float(statistics.median(vals))

    return Sample(min(steps), pick(1), pick(2), bad)


def skip_for(c: StabilityConfig, target: int, f: Finding) -> int:
    """Batches a rollback to ``target`` skips: ``skip_batches``, or more where that would not
    pass the anomaly. The batches that caused it lie somewhere in ``[f.began, f.step]`` (the
    samples are sparse: one beat a second), and the checkpoint may lie further back than
    ``rollback_steps``; so the skip reaches at least ``skip_batches - rollback_steps`` batches
    past the last step seen anomalous -- the margin past the anomaly the two settings give when
    the onset is exact and a checkpoint sits ``rollback_steps`` before it."""
    past = max(0, c.skip_batches - c.rollback_steps)
    return max(c.skip_batches, f.step + past - target)


@dataclass
class Guard:
    """The stability policy of one job: the detector, the checkpoints a rollback may use,
    the rollbacks so far, and the hint the next launch carries (until a newer checkpoint
    than the hint's makes it moot)."""

    cfg: StabilityConfig
    detector: Detector = field(init=False)
    ckpt_steps: List[int] = field(default_factory=list)
    rollbacks: List[int] = field(default_factory=list)     # anomaly steps of the rollbacks so far
    hint: Optional[ResumeHint] = None
    findings: int = 0
    # What the last rollback decision replaced (hint, checkpoint steps): a rollback the disk
    # cannot back (:meth:`retarget` with no checkpoint) is undone, not counted.
    _undo: Optional[Tuple[Optional[ResumeHint], List[int]]] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.detector = Detector(self.cfg)

    # -- what the machine tells it -----------------------------------------------------
    def checkpoint(self, step: int) -> None:
        if step not in self.ckpt_steps:
            self.ckpt_steps.append(step)
            self.ckpt_steps.sort()
        if self.hint is not None and step > self.hint.from_step:
            self.hint = None           # saved past the skipped window: the skip is in the checkpoint

    def launched(self, resume_step: Optional[int]) -> None:
        self.detector.resumed(resume_step)

    def feed(self, signals: Mapping[int, Tuple[int, Optional[float], Optional[float]]]) -> Optional[Decision]:
        s = sample_of(signals)
        if s is None:
            return None
        f = self.detector.feed(s)
        return None if f is None else self.decide(f)

    # -- deciding ------------------------------------------------------------------------
    def decide(self, f: Finding) -> Decision:
        self.findings += 1
        action = Action(self.cfg.on_nan if f.kind == Kind.NAN else self.cfg.on_spike)
        keep = rollback_target(self.ckpt_steps, f.began - 1)
        if action == Action.REPLAY:
            return self._replay(f, keep)
        if action != Action.ROLLBACK:
            return Decision(action, f, why=f"on_{'nan' if f.kind == Kind.NAN else 'spike'}: {action}", hold=keep)
        return self.decide_rollback(f)

    def decide_rollback(self, f: Finding) -> Decision:
        """The rollback with a skip (``on_*: rollback``, or a replay that reproduced the finding)."""
        keep = rollback_target(self.ckpt_steps, f.began - 1)
        c = self.cfg
        over = self._over_budget(f, keep)
        if over is not None:
            return over
        before = f.began - c.rollback_steps
        target = rollback_target(self.ckpt_steps, before)
        if target is None:
            return Decision(Decision.GIVE_UP, f, why=f"no checkpoint at or before step {before} to roll back to",
                            hold=keep)
        self._undo = (self.hint, list(self.ckpt_steps))
        self.rollbacks.append(f.began)
        self.hint = ResumeHint(from_step=target, skip_batches=skip_for(c, target, f), lr_factor=c.lr_factor,
                               anomaly_step=f.began, rollback=len(self.rollbacks))
        # The checkpoints after the target belong to the discarded timeline.
        self.ckpt_steps = [s for s in self.ckpt_steps if s <= target]
        return Decision(Action.ROLLBACK, f, hint=self.hint, hold=target, before=before,
                        why=f"newest checkpoint at least {c.rollback_steps} steps before step {f.began}")

    def _replay(self, f: Finding, keep: Optional[int]) -> Decision:
        """``on_*: replay``: rerun the steps from the newest checkpoint before the anomaly began
        up to ``replay_margin_steps`` past the step it was seen at, on other nodes, before
        deciding (:func:`judge_replay`). Nothing counts against the rollback budget yet: the
        verdict's rollback does. No checkpoint before the anomaly: a give-up, as a rollback."""
        c = self.cfg
        over = self._over_budget(f, keep)
        if over is not None:
            return over
        if keep is None:
            return Decision(Decision.GIVE_UP, f, why=f"no checkpoint at or before step {f.began - 1} to replay "
                                                     "from", hold=None)
        hint = ResumeHint(from_step=keep, skip_batches=0, lr_factor=1.0, reason="replay", anomaly_step=f.began,
                          rollback=len(self.rollbacks))
        return Decision(Action.REPLAY, f, hint=hint, hold=keep, before=f.began - 1,
                        why=f"replay from the newest checkpoint before step {f.began} to at least step "
                            f"{f.step + c.replay_margin_steps} on other nodes: data or hardware?")

    def _over_budget(self, f: Finding, keep: Optional[int]) -> Optional[Decision]:
        """The give-up when ``max_rollbacks`` rollbacks already began within
        ``rollback_window_steps`` of ``f`` (holding ``keep``); None while there is budget."""
        c = self.cfg
        recent = [a for a in self.rollbacks if abs(f.began - a) <= c.rollback_window_steps]
        if len(recent) >= c.max_rollbacks:
            return Decision(Decision.GIVE_UP, f, why=f"{len(recent)} rollbacks within {c.rollback_window_steps} "
                                                     f"steps (max_rollbacks {c.max_rollbacks})", hold=keep)
        return None

    def replayed(self, from_step: int) -> None:
        """The replay runs from checkpoint ``from_step``: the later ones were set aside."""
        self.ckpt_steps = [s for s in self.ckpt_steps if s <= from_step]

    def decide_clean_rollback(self, f: Finding, before: int, why: str) -> Decision:
        """Back to the newest checkpoint at or before ``before`` with nothing skipped and the
        learning rate unchanged (the data was not at fault: the rerun must be the same run);
        counted against the rollback budget (``max_rollbacks`` within ``rollback_window_steps``)."""
        keep = rollback_target(self.ckpt_steps, before)
        over = self._over_budget(f, keep)
        if over is not None:
            return over
        if keep is None:
            return Decision(Decision.GIVE_UP, f, why=f"no checkpoint at or before step {before}, {why}", hold=None)
        self._undo = (self.hint, list(self.ckpt_steps))
        self.rollbacks.append(f.began)
        self.hint = ResumeHint(from_step=keep, skip_batches=0, lr_factor=1.0, anomaly_step=f.began,
                               rollback=len(self.rollbacks))
        self.ckpt_steps = [s for s in self.ckpt_steps if s <= keep]
        return Decision(Action.ROLLBACK, f, hint=self.hint, hold=keep, before=before,
                        why=f"newest checkpoint at or before step {before}, {why}")

    def decide_sdc(self, f: Finding) -> Decision:
        """Replicas that disagree (``f.kind`` SDC, ``f.began`` the step after the last check that
        agreed): roll back to the newest checkpoint at or before that check -- any later one may
        hold the corruption -- with nothing skipped and the learning rate unchanged (the data
        was not at fault, so the replay must be the same run). The rollback budget
        (``max_rollbacks`` within ``rollback_window_steps``) and the holds are the guard's."""
        self.findings += 1
        return self.decide_clean_rollback(f, f.began - 1, "the last replica check that agreed")

    def retarget(self, d: Decision, step: Optional[int], problems: str = "") -> Decision:
        """Rollback ``d`` once the disk was looked at: ``step`` is the newest checkpoint at
        or before ``d.before`` that exists and verifies (None: none does; ``problems`` says
        what was wrong with those that did not). The same target: ``d`` itself. Another: the
        rollback goes there (a new hint; the guard forgets the steps above it, which are gone
        or bad). None: the rollback is undone and the decision is a give-up -- restarting
        from a checkpoint the rule does not allow, or from nothing, is a person's call."""
        if d.action != Action.ROLLBACK or d.hint is None:
            return d
        if step is not None and step > d.before:
            raise ValueError(f"rollback target step {step} is after the bound {d.before}")
        if step == d.hint.from_step:
            return d
        if step is None:
            if self.rollbacks and self.rollbacks[-1] == d.hint.anomaly_step:
                self.rollbacks.pop()
            if self._undo is not None:
                self.hint, steps = self._undo
                self.ckpt_steps = [s for s in steps if s > d.before]   # those at or before it failed
            self._undo = None
            # What retention must keep now: the newest checkpoint before the anomaly (the ones
            # at or before the bound failed), for the person who takes it from here.
            return Decision(Decision.GIVE_UP, d.finding, hold=rollback_target(self.ckpt_steps, d.finding.began - 1),
                            why=f"no checkpoint at or before step {d.before} exists and verifies"
                                + (f" ({problems})" if problems else ""))
        self._undo = None
        self.hint = replace(d.hint, from_step=step, skip_batches=skip_for(self.cfg, step, d.finding))
        self.ckpt_steps = sorted({s for s in self.ckpt_steps if s < step} | {step})
        why = f"{d.why} that exists and verifies: step {step}" + (f" ({problems})" if problems else "")
        return replace(d, hint=self.hint, hold=step, why=why)


def rollback_target(ckpt_steps: Sequence[int], before: int) -> Optional[int]:
    """The newest checkpoint step at or before ``before``; None when there is none."""
    ok = [s for s in ckpt_steps if s <= before]
    return max(ok) if ok else None


# ------------------------------------------------------------------------------ replay
class ReplayVerdict(str, Enum):
    """What a replay of an anomaly says (the ``replay_decided`` record's ``verdict``)."""

    DATA = "data"              # reproduced: the batches did it; roll back with the skip
    HARDWARE = "hardware"      # not reproduced, and one node's ranks saw it first: that node
    AMBIGUOUS = "ambiguous"    # not reproduced but no single node to name, or the replay could not tell

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ReplayJudgement:
    verdict: ReplayVerdict
    reproduced: Optional[bool]          # None: the replay could not tell (crashed, reports missing)
    why: str
    node: Optional[str] = None          # HARDWARE: the suspect
    ranks: Tuple[int, ...] = ()         # the ranks that saw it first in the original run
    replay_step: Optional[int] = None   # where the replay saw it (reproduced)


def origin(nonfinite: Mapping[int, Tuple[int, str]]) -> Tuple[Optional[int], Tuple[int, ...], Tuple[str, ...]]:
    """rank -> (first non-finite step, node) of the original run -> (the earliest step, the ranks
    that saw it then, their nodes); (None, (), ()) with no evidence."""
    if not nonfinite:
        return None, (), ()
    first = min(s for s, _ in nonfinite.values())
    ranks = tuple(sorted(r for r, (s, _) in nonfinite.items() if s == first))
    nodes = tuple(sorted({nonfinite[r][1] for r in ranks if nonfinite[r][1]}))
    return first, ranks, nodes


def replay_until(f: Finding, nonfinite: Mapping[int, Tuple[int, str]], margin: int) -> int:
    """The step a replay of ``f`` runs to: ``margin`` steps past the later of the step the
    guard saw the anomaly at and the step the ranks first reported a non-finite value at
    (``nonfinite``, rank -> (step, node)); a replay that stops before the original run's first
    non-finite step cannot reproduce it, and must not pass for a clean one."""
    first, _, _ = origin(nonfinite)
    return max(f.step, first if first is not None else f.step) + margin


def judge_replay(f: Finding, nonfinite: Mapping[int, Tuple[int, str]], reports: Mapping[int, Mapping],
                 *, ranks: int, until: int, single_node: bool = False) -> ReplayJudgement:
    """Data or hardware (pure). ``f``: the finding; ``nonfinite``: rank -> (first non-finite step,
    node) in the original run (the SDK's reports); ``reports``: rank -> the replay's report
    (``protocol.read_replay``: ``reached``, ``first_nonfinite``, ``losses`` {step: value});
    ``ranks``: how many ranks the replay ran; ``until``: the step it was to reach;
    ``single_node``: the original run had one node (its ranks all went non-finite there).

    - a non-finite finding is reproduced when the replay goes non-finite at the step the original
      run first did (any step from ``f.began`` to ``until`` when the original run named none);
      a spike when the median of the ranks' replayed losses at a step from ``f.began`` to
      ``until`` is above the band's limit again: DATA (``until`` and not ``f.step``: the guard's
      step comes from beats a second apart, and may lag the step the values were at);
    - a complete replay (every rank reached ``until``, and the original run's first non-finite
      step when that is later) that is clean: not reproduced. The node
      whose ranks went non-finite first in the original run is the suspect (HARDWARE); with no
      such single node (a spike, or every node at once) nobody is named (AMBIGUOUS);
    - anything else (a non-finite value at another step, a replay that ended early): AMBIGUOUS,
      the replay could not tell."""
    first, first_ranks, first_nodes = origin(nonfinite)
    need = max(until, first) if first is not None else until
    complete = len(reports) >= ranks and all(_int(r.get("reached"), -1) >= need for r in reports.values())
    if f.kind == Kind.NAN:
        got = [_int(r.get("first_nonfinite"), None) for r in reports.values()]
        seen = min((g for g in got if g is not None), default=None)
        lo, hi = (first, first) if first is not None else (f.began, until)
        if seen is not None and lo <= seen <= hi:
            return ReplayJudgement(ReplayVerdict.DATA, True, f"the replay went non-finite at step {seen} too, on "
                                   "other nodes: the data", ranks=first_ranks, replay_step=seen)
        if seen is not None:
            return ReplayJudgement(ReplayVerdict.AMBIGUOUS, None, f"the replay went non-finite at step {seen}, "
                                   f"the original run at step {first if first is not None else f.step}",
                                   ranks=first_ranks, replay_step=seen)
    else:
        limit = f.band[1]
        for step in range(f.began, until + 1):
            vals = [_num(r.get("losses", {}).get(str(step))) for r in reports.values()]
            vals = [v for v in vals if v is not None]
            if vals and limit is not None and (not all(math.isfinite(v) for v in vals)
                                               or statistics.median(vals) > limit):
                return ReplayJudgement(ReplayVerdict.DATA, True, f"the replay's loss at step {step} is above the "
                                       f"band's limit {limit:g} too: the data", replay_step=step)
    if not complete:
        return ReplayJudgement(ReplayVerdict.AMBIGUOUS, None, f"the replay did not reach step {need} on every "
                               f"rank ({len(reports)} of {ranks} reported): it cannot tell", ranks=first_ranks)
    if len(first_nodes) == 1 and (len(first_ranks) < ranks or single_node):
        return ReplayJudgement(ReplayVerdict.HARDWARE, False, f"not reproduced on other nodes; rank(s) "
                               f"{','.join(map(str, first_ranks))} on {first_nodes[0]} went non-finite first "
                               f"(step {first})", node=first_nodes[0], ranks=first_ranks)
    who = ("no rank reported where it began" if first is None else
           f"rank(s) {','.join(map(str, first_ranks))} on {', '.join(first_nodes) or '?'} went non-finite "
           f"together at step {first}")
    return ReplayJudgement(ReplayVerdict.AMBIGUOUS, False, f"not reproduced on other nodes, but {who}: no single "
                           "node to name", ranks=first_ranks)


def _int(v, default):
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _num(v) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None
