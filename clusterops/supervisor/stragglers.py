"""Finding the slow node of a running job from its heartbeats: pure, no clock, no I/O.

**What is measured.** In a synchronous job (data parallel, one all-reduce a step) every
rank finishes a step at nearly the same moment: the fast ranks wait in the collective
for the slow one. Step time per rank is therefore the same everywhere and cannot name
the slow rank. What differs is *busy* time -- the time a rank spends on its own work
(``sdk.compute()`` blocks: forward, backward, optimizer step), not waiting for the
others. A throttled GPU or a contended CPU makes its rank's busy time longer while the
others' busy time stays and their wait grows. The heartbeat datagram carries, per rank,
its mean busy time per step over the last beat interval (``clusterops.heartbeat``).
A script that does not mark its compute sends no busy time; then the mean step time is
used, which finds slow nodes only of jobs whose ranks do not wait for each other.

**The rule.** Each beat with new progress (a higher step than the rank's last one) is one
sample of that rank. Samples of the first ``warmup_steps`` steps after a (re)start are
ignored (imports, caches, the first compilation), and so are intervals in which a
checkpoint was saved (the SDK sends -1 for them). A node's figure is the median of its
ranks' last ``window`` samples (pooled); a node takes part once it has ``window``
samples. A node whose figure is at least ``ratio`` times the median of the *other*
nodes' figures, and at least ``MIN_EXCESS_MS`` more, in ``window`` evaluations in a row
(one evaluation per heartbeat snapshot that brought new samples), is a straggler. So
one slow beat (a save the SDK did not report, a hiccup) moves no median, and a node is
named only after a sustained slowdown: about ``1.5 x window`` beats, a beat a second.

Needs two nodes at least; the ranks of one node are not compared with each other.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["MIN_EXCESS_MS", "Finding", "Detector", "median"]

#: A node must be at least this much slower per step (ms) than the others, besides the
#: ratio: 2 ms against 1 ms is noise, not a straggler.
MIN_EXCESS_MS = 5.0

# rank -> (step, step_ms, busy_ms) of its latest beat; -1: not known.
Timing = Mapping[int, Tuple[int, int, int]]


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("median of nothing")
    return float(v[n // 2]) if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2.0


def _median_without(ordered: Sequence[float], value: float) -> float:
    """The median of sorted ``ordered`` with one element equal to ``value`` left out, in
    O(log n) (every node against all the others: no O(n^2) at thousands of nodes)."""
    i = bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return float(at(m // 2)) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2.0


@dataclass(frozen=True)
class Finding:
    """A node found slow: its figure, the others' median, the ratio, what was measured."""

    node: str
    ratio: float
    node_ms: float
    others_ms: float
    measure: str                 # "busy" (sdk.compute time) or "step" (step time)
    ranks: Tuple[int, ...]
    step: int                    # the lowest step of its ranks when found


class Detector:
    """Feed it heartbeat timings (:meth:`feed`); it returns nodes newly found slow.

    ``rank_node`` maps a rank to its node (None: not a rank of this step). One detector
    per launch: a relaunch starts over (new nodes, a new warm-up).
    """

    def __init__(self, rank_node: Callable[[int], Optional[str]], *, ratio: float = 1.5, window: int = 10,
                 warmup_steps: int = 20):
        self.rank_node = rank_node
        self.ratio = float(ratio)
        self.window = max(1, int(window))
        self.warmup_steps = max(0, int(warmup_steps))
        self.node_of: Dict[int, Optional[str]] = {}
        self.first_step: Dict[int, int] = {}
        self.last_step: Dict[int, int] = {}
        self.ranks: Dict[str, List[int]] = {}                    # node -> its ranks seen
        # node -> the last window x ranks samples of its ranks, pooled: busy and step times
        self.busy: Dict[str, Deque[int]] = {}
        self.steps: Dict[str, Deque[int]] = {}
        self.streak: Dict[str, int] = {}
        self.flagged: Dict[str, Finding] = {}
        self.ratios: Dict[str, float] = {}                       # node -> latest ratio
        self.measure: Optional[str] = None                       # of the latest evaluation

    def _node(self, rank: int) -> Optional[str]:
        node = self.node_of.get(rank, "")
        if node == "":
            node = self.node_of[rank] = self.rank_node(rank)
            if node is not None:
                mine = self.ranks.setdefault(node, [])
                mine.append(rank)
                size = self.window * len(mine)
                self.busy[node] = deque(self.busy.get(node, ()), maxlen=size)
                self.steps[node] = deque(self.steps.get(node, ()), maxlen=size)
        return node

    def feed(self, timing: Timing) -> List[Finding]:
        fresh = False
        first, last, warm, node_of = self.first_step, self.last_step, self.warmup_steps, self.node_of
        for rank, beat in timing.items():
            try:
                step, step_ms, busy_ms = beat
            except (TypeError, ValueError):
                continue
            node = node_of.get(rank, "")
            if node == "":
                node = self._node(rank)
            if node is None:
                continue
            if rank not in first:
                # The first beat of a rank in this launch: where it started, not a sample.
                first[rank] = last[rank] = step
                continue
            if step <= last[rank]:
                continue
            last[rank] = step
            if step <= first[rank] + warm:
                continue
            # -1 for both: a save fell in this interval (or nothing is known).
            if busy_ms >= 0:
                self.busy[node].append(busy_ms)
                fresh = True
            if step_ms >= 0:
                self.steps[node].append(step_ms)
                fresh = True
        return self._evaluate() if fresh else []

    def _figures(self) -> Tuple[Optional[str], Dict[str, float]]:
        w = self.window
        ready = [n for n in self.ranks if len(self.busy[n]) >= w or len(self.steps[n]) >= w]
        if len(ready) < 2:
            return None, {}
        # Busy time when every node taking part has enough of it, else step time.
        if all(len(self.busy[n]) >= w for n in ready):
            return "busy", {n: median(self.busy[n]) for n in ready}
        steps = {n: median(self.steps[n]) for n in ready if len(self.steps[n]) >= w}
        return ("step", steps) if len(steps) >= 2 else (None, {})

    def _evaluate(self) -> List[Finding]:
        measure, figs = self._figures()
        if measure is None:
            return []
        self.measure = measure
        found = []
        ordered = sorted(figs.values())
        for node, value in sorted(figs.items()):
            others = _median_without(ordered, value)
            ratio = value / others if others > 0 else (float("inf") if value > 0 else 1.0)
            self.ratios[node] = round(ratio, 3) if ratio != float("inf") else ratio
            slow = ratio >= self.ratio and value - others >= MIN_EXCESS_MS
            self.streak[node] = self.streak.get(node, 0) + 1 if slow else 0
            if slow and self.streak[node] >= self.window and node not in self.flagged:
                rs = tuple(sorted(self.ranks.get(node, ())))
                f = Finding(node=node, ratio=round(ratio, 3), node_ms=round(value, 1), others_ms=round(others, 1),
                            measure=measure, ranks=rs, step=min(self.last_step[r] for r in rs))
                self.flagged[node] = f
                found.append(f)
        return found

    def slowest(self) -> Optional[Tuple[str, float]]:
        """(node, ratio) of the slowest node at the latest evaluation, None before one."""
        if not self.ratios:
            return None
        node = max(sorted(self.ratios), key=lambda n: self.ratios[n])
        return node, self.ratios[node]
