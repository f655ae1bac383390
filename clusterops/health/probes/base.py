"""Probe results and the deadline runner every probe goes through.

A probe is a function ``fn(config: dict, ctx: ProbeContext) -> list[ProbeResult]``.
``run_probes`` runs each probe in a daemon worker thread and waits for it only until
its own deadline: a probe stuck in an NVML call or in a ``stat`` on a dead mount
becomes one ``error`` result naming the probe, and the check goes on. (A thread
cannot be killed; it is left behind as a daemon and the CLI exits with ``os._exit``
when one was abandoned, so even a thread blocked in the kernel cannot hold the
process. Probes that touch filesystems do the blocking part in a child process
through the Runner, so the check process itself never enters the kernel wait.)
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from clusterops.runner import Runner

STATUSES = ("pass", "warn", "fail", "skip", "error")
# How bad each status is when several are folded into one.
_RANK = {"skip": 0, "pass": 1, "warn": 2, "error": 3, "fail": 4}


@dataclass
class ProbeResult:
    """One checked rule. ``detail`` is one line and says what to do when not passing."""

    name: str
    status: str
    value: Any = None
    unit: str = ""
    threshold: Any = None
    detail: str = ""
    duration_s: float = 0.0
    data: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"bad probe status {self.status!r}")
        # One line, always: reasons end up in Slurm drain reasons and table cells.
        self.detail = " ".join(str(self.detail).split())

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["duration_s"] = round(float(self.duration_s), 4)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProbeResult":
        keys = ("name", "status", "value", "unit", "threshold", "detail", "duration_s", "data")
        return cls(**{k: d[k] for k in keys if k in d})


def worst(statuses: Sequence[str]) -> str:
    """The worst of several statuses (fail > error > warn > pass > skip)."""
    out = "skip"
    for s in statuses:
        if _RANK[s] > _RANK[out]:
            out = s
    return out


def overall_status(results: Sequence[ProbeResult]) -> str:
    """Fold results into the report status: pass | warn | fail | error."""
    statuses = {r.status for r in results}
    if "fail" in statuses:
        return "fail"
    if "error" in statuses:
        return "error"
    if "warn" in statuses:
        return "warn"
    return "pass"


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def node_name(env: Optional[Mapping[str, str]] = None) -> str:
    """This node's Slurm name: SLURMD_NODENAME (set for jobs and by slurmd), else the short hostname."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or short_hostname()


@dataclass
class ProbeContext:
    """What probes share: the runner, the environment, where state lives, and
    the hardware library handles (injected in tests)."""

    runner: Runner = field(default_factory=Runner)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    state_dir: Optional[str] = None
    nvml: Any = None                 # a pynvml-like module; None -> import pynvml lazily
    gpu_models: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    gpus_required: bool = False
    node: str = field(default_factory=node_name)
    cache: Dict[str, Any] = field(default_factory=dict)
    # Where the host's /proc and /dev are read from: "/" or $CLUSTEROPS_HOST_ROOT (a checker
    # in a container with the host's root mounted at, say, /host; tests use a tmp tree).
    host_root: str = field(default_factory=lambda: os.environ.get("CLUSTEROPS_HOST_ROOT") or "/")
    # Slurm's count of GPUs for ``node``: a callable (node, timeout_s) -> int | None;
    # None -> ask Slurm (only when the node shows GPUs; see probes.nvml).
    slurm_gpus: Optional[Callable[[str, float], Optional[int]]] = None
    amdsmi: Any = None               # an amdsmi-like module; None -> import amdsmi lazily (probes.amd)
    # Slurm's gres text for ``node`` (node, timeout_s) -> str | None; None -> ask Slurm (probes.amd).
    slurm_gres: Optional[Callable[[str, float], Optional[str]]] = None


ProbeFn = Callable[[Dict[str, Any], ProbeContext], List[ProbeResult]]


@dataclass
class ProbeSpec:
    name: str
    fn: ProbeFn
    config: Dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    # Exclusive probes (matmul, bandwidth, DCGM) run one at a time after the light
    # ones, so they do not measure each other.
    exclusive: bool = False


@dataclass
class RunOutcome:
    results: List[ProbeResult]
    abandoned: List[str]  # probes whose worker thread was left behind at its deadline

    @property
    def hung(self) -> bool:
        return bool(self.abandoned)


class _Job:
    def __init__(self, spec: ProbeSpec, ctx: ProbeContext):
        self.spec = spec
        self.ctx = ctx
        self.results: Optional[List[ProbeResult]] = None
        self.done = threading.Event()
        self.start = 0.0
        self.thread = threading.Thread(target=self._run, name=f"probe-{spec.name}", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            res = list(self.spec.fn(dict(self.spec.config), self.ctx) or [])
        except Exception as e:  # a probe bug or an unexpected library error
            res = [ProbeResult(self.spec.name, "error",
                               detail=f"probe raised {type(e).__name__}: {e}; "
                                      "rerun with -vv and report it")]
        elapsed = time.monotonic() - t0
        for r in res:
            if not r.duration_s:
                r.duration_s = elapsed
        self.results = res
        self.done.set()

    def begin(self) -> None:
        self.start = time.monotonic()
        self.thread.start()

    def finish(self) -> List[ProbeResult]:
        remaining = self.start + self.spec.timeout_s - time.monotonic()
        if self.done.wait(max(0.0, remaining)) and self.results is not None:
            return self.results
        return [ProbeResult(
            self.spec.name, "error", threshold=self.spec.timeout_s, unit="s",
            value=round(time.monotonic() - self.start, 3), duration_s=time.monotonic() - self.start,
            detail=f"probe did not finish within {self.spec.timeout_s:g}s (hung driver call or "
                   "filesystem?); check the node by hand before returning it to service")]


def run_probes(specs: Sequence[ProbeSpec], ctx: ProbeContext) -> RunOutcome:
    """Run every probe under its own deadline; results keep the order of ``specs``."""
    light = [_Job(s, ctx) for s in specs if not s.exclusive]
    for j in light:
        j.begin()
    by_name: Dict[int, List[ProbeResult]] = {}
    abandoned: List[str] = []
    for j in light:
        by_name[id(j.spec)] = j.finish()
        if not j.done.is_set():
            abandoned.append(j.spec.name)
    for s in specs:
        if not s.exclusive:
            continue
        j = _Job(s, ctx)
        j.begin()
        by_name[id(s)] = j.finish()
        if not j.done.is_set():
            abandoned.append(s.name)
    results: List[ProbeResult] = []
    for s in specs:
        results.extend(by_name[id(s)])
    return RunOutcome(results, abandoned)


def run_one(fn: ProbeFn, config: Dict[str, Any], ctx: ProbeContext, *, name: str,
            timeout_s: float) -> List[ProbeResult]:
    """Run a single probe function under a deadline (convenience for library users)."""
    return run_probes([ProbeSpec(name, fn, config, timeout_s)], ctx).results
