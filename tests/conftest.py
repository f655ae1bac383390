"""Shared test fixtures.

The ``devcluster`` fixture brings up one real 4-node Slurm cluster (4 counted GPUs
per node) for the whole session, on ports picked free for this run, and points
SLURM_CONF at it. ``cluster`` is the per-test handle: after each test it cancels
leftover jobs, restarts stopped slurmds and resumes drained nodes so tests do not
leak state into each other.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

DEV_NODES = 4
DEV_GPUS = 4

# The host's own clusterops state stays out of the suite, and each test process (the
# pytest-xdist workers run at once, each with its own dev cluster whose nodes have the same
# names) has its own: per-node probe state ($CLUSTEROPS_STATE_DIR, e.g. xid-node1.json) and
# the sweep's database and lock ($CLUSTEROPS_SWEEP_DB). Sticky and world-writable, like
# /tmp, for the tests that run as another user. A test that sets them keeps its own.
# The workers inherit the first process's environment (its values of these two as well),
# so each one recognises that process's defaults and puts its own directory in their place.
_INHERITED_STATE = os.environ.get("CLUSTEROPS_TEST_HOST_STATE")
if _INHERITED_STATE and os.path.isdir(_INHERITED_STATE):
    _HOST_STATE = Path(_INHERITED_STATE)
    _OWN_STATE = _HOST_STATE / (os.environ.get("PYTEST_XDIST_WORKER") or f"p{os.getpid()}")
else:
    _INHERITED_STATE = None
    _HOST_STATE = Path(tempfile.mkdtemp(prefix="clusterops-test-state-"))
    _HOST_STATE.chmod(0o1777)
    os.environ["CLUSTEROPS_TEST_HOST_STATE"] = str(_HOST_STATE)
    _OWN_STATE = _HOST_STATE / "main"
_OWN_STATE.mkdir(exist_ok=True)
_OWN_STATE.chmod(0o1777)
for _key, _name in (("CLUSTEROPS_STATE_DIR", "state"), ("CLUSTEROPS_SWEEP_DB", "sweep.db"), ("CLUSTEROPS_JOBS_DIR", "jobs")):
    if os.environ.get(_key) in (None, str(_HOST_STATE / "main" / _name)):
        os.environ[_key] = str(_OWN_STATE / _name)
# Reference runs (support.faultkit.run_local) shared by the whole session: the workers
# inherit the first process's directory.
os.environ.setdefault("CLUSTEROPS_TEST_REF_CACHE", str(_HOST_STATE / "reference-runs"))


def pick_port_base(count: int) -> int:
    env = os.environ.get("CLUSTEROPS_TEST_PORT_BASE")
    if env:
        return int(env)
    from clusterops.devcluster import free_port_base

    return free_port_base(count, worker_port_window())


@contextlib.contextmanager
def own_dev_cluster(name: str):
    """A dev cluster of one test's own, beside the worker's shared one: a DevCluster on a fresh
    state directory (``clusterops-test-dc<name>-*``) that the caller brings up with the
    config it needs; stopped and removed however the test ends, an ``up`` that failed
    halfway included."""
    from clusterops.devcluster import DevCluster

    state = Path(tempfile.mkdtemp(prefix=f"clusterops-test-dc{name}-"))
    dc = DevCluster(state)
    try:
        yield dc
    finally:
        dc.down()
        shutil.rmtree(state, ignore_errors=True)


def worker_port_window() -> tuple:
    """This test process's share of devcluster.PORT_BASE_WINDOW for dev-cluster daemons.

    Below 10000: out of the kernel's ephemeral range (32768+), where client sockets come and
    go, and out of the window runner.free_port picks rendezvous ports from (10000+), so a
    training step never takes the port of a slurmd that a test stopped and restarts. The
    pytest-xdist workers (PYTEST_XDIST_WORKER=gwN of PYTEST_XDIST_WORKER_COUNT) each get a
    disjoint slice, so two workers starting their clusters at the same second never pick
    the same ports."""
    from clusterops.devcluster import PORT_BASE_WINDOW

    lo, hi = PORT_BASE_WINDOW
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        span = (hi - lo) // count
        lo = lo + int(worker[2:]) % count * span
        hi = lo + span
    return lo, hi


@pytest.fixture(scope="session")
def devcluster():
    from clusterops.devcluster import DevCluster, DevClusterConfig
    from clusterops.slurm.tools import SlurmTools

    state = Path(tempfile.mkdtemp(prefix="clusterops-test-dc-"))
    dc = DevCluster(state)
    # CLUSTEROPS_SLURM_PREFIX=/opt/slurm-25.11 runs the whole session on that Slurm.
    prefix = os.environ.get("CLUSTEROPS_SLURM_PREFIX") or None
    # slurmrestd (JWT) beside it wherever it is installed (scripts/setup.sh installs it), for
    # the REST backend's tests; its port is the one after the nodes'.
    restd = not SlurmTools.for_prefix(prefix).missing(["slurmrestd"])
    cfg = DevClusterConfig(nodes=DEV_NODES, gpus_per_node=DEV_GPUS, cpus_per_node=2,
                           port_base=pick_port_base(DEV_NODES + 1), slurm_prefix=prefix, restd=restd)
    dc.up(cfg)
    # SLURM_CONF, and PATH with the prefix's bin/ first for the tests' own Slurm calls.
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    os.environ.update(dc.env())
    try:
        yield dc
    finally:
        dc.down()
        shutil.rmtree(state, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _restore(dc) -> None:
    """Put the shared cluster back to 4 idle nodes with no jobs."""
    from clusterops.errors import ClusteropsError
    from clusterops.runner import Runner, pid_alive
    from support.wait import wait_for

    run = Runner(env=dc.env()).run
    run(["scancel", "--full", "--user=root"], timeout_s=30, check=False)
    # The jobs are gone: so are their submission records (this worker's own registry), or a
    # later test's `job watch` would judge a job an earlier, failed test left behind.
    jobs_dir = os.environ.get("CLUSTEROPS_JOBS_DIR", "")
    if jobs_dir.startswith(str(_OWN_STATE) + os.sep):
        shutil.rmtree(jobs_dir, ignore_errors=True)
    cfg = dc.config()
    for name in cfg.node_names:
        dc.ensure_scratch(name)   # a test that broke a node's scratch leaves it as every user needs it
        if not pid_alive(dc.daemon_pids().get(f"slurmd:{name}")):
            dc.start_node(name)

    def idle() -> bool:
        try:
            states = dc.node_states()
        except ClusteropsError:
            return False
        bad = [n for n in cfg.node_names if states.get(n) != "idle"]
        for n in bad:
            st = states.get(n, "")
            if "drain" in st or st.startswith("down"):
                run(["scontrol", "update", f"NodeName={n}", "State=RESUME"], timeout_s=30, check=False)
        return not bad

    def detail() -> str:      # what a failure needs to be read later: each bad node's daemon and log
        from clusterops.devcluster import _tail

        states, pids = dc.node_states(), dc.daemon_pids()
        bad = [n for n in cfg.node_names if states.get(n) != "idle"]
        return f"{states}; " + "; ".join(
            f"{n}: slurmd pid {pids.get(f'slurmd:{n}')}, log: {_tail(dc.state / 'log' / f'slurmd-{n}.log')}" for n in bad)

    wait_for(idle, 60, "the dev cluster back to 4 idle nodes", interval_s=0.5, detail=detail)


@pytest.fixture
def cluster(devcluster):
    """The shared dev cluster, restored to a clean state after the test."""
    _restore(devcluster)
    yield devcluster
    _restore(devcluster)


# A real PostgreSQL server (session) and a fresh history database per backend (per test).
from support.pgserver import history_target, postgres_server  # noqa: E402,F401


_modules_at_freeze = [0]


def pytest_runtest_setup(item):
    """Keep the cyclic garbage collector off the heavy imports' objects.

    torch, numpy, hypothesis and the rest leave millions of long-lived objects; every full
    collection walks them all, and a test that makes much garbage (hypothesis) ran 5x
    slower after torch was imported than before. When a batch of modules has been imported
    since the last time, collect once and move what survives to the permanent generation
    (gc.freeze): later garbage is still collected as usual."""
    import gc

    if len(sys.modules) - _modules_at_freeze[0] > 100:
        gc.collect()
        gc.freeze()
        _modules_at_freeze[0] = len(sys.modules)


def pytest_collection_modifyitems(config, items):
    """The device tiers are deselected (not skipped: they are not in the CPU suite's count)
    unless the -m expression names them: ``-m gpu`` (NVIDIA), ``-m rocm`` (AMD). Then the
    dev-cluster tests go first, longest first (see :func:`longest_first`)."""
    expr = config.option.markexpr or ""
    tiers = [t for t in ("gpu", "rocm") if t not in expr]
    if tiers:
        keep, drop = [], []
        for item in items:
            (drop if any(item.get_closest_marker(t) for t in tiers) else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    longest_first(items, _known_durations())


# Each test's seconds (setup + call + teardown) from a full run, for the order below. Refresh:
# CLUSTEROPS_TEST_DURATIONS_OUT=tests/durations.json bash scripts/test.sh
DURATIONS = REPO / "tests" / "durations.json"
UNKNOWN_DEVCLUSTER_S = 30.0     # a dev-cluster test not in the file yet: about a median one


def _known_durations() -> dict:
    import json

    try:
        body = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def longest_first(items, known: dict) -> None:
    """Dev-cluster tests first, longest first, then the unit tests in their own order.

    The workers take the next test as they finish one (pytest-xdist's load scheduling keeps
    this order), so the suite's wall time is that of the busiest worker: a two-minute test
    begun last makes the other workers wait idle at the end, while short unit tests fill
    the gaps well. Unit tests keep their module order (their module fixtures stay set up);
    the integration modules' expensive shared pieces (reference runs) are cached across
    modules and workers (support.faultkit.run_local)."""
    def is_devcluster(item) -> bool:
        return "/integration/" in str(item.fspath).replace(os.sep, "/")

    heavy = [it for it in items if is_devcluster(it)]
    light = [it for it in items if not is_devcluster(it)]
    heavy.sort(key=lambda it: -float(known.get(it.nodeid, UNKNOWN_DEVCLUSTER_S)))   # stable: ties keep order
    items[:] = heavy + light


_recorded: dict = {}


def pytest_runtest_logreport(report):
    if os.environ.get("CLUSTEROPS_TEST_DURATIONS_OUT"):
        _recorded[report.nodeid] = _recorded.get(report.nodeid, 0.0) + float(report.duration)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("CLUSTEROPS_TEST_DURATIONS_OUT")
    if out and _recorded and not os.environ.get("PYTEST_XDIST_WORKER"):
        import json

        Path(out).write_text(json.dumps({k: round(v, 1) for k, v in sorted(_recorded.items())}, indent=0) + "\n")


def pytest_unconfigure(config):
    # A worker removes its own part only: the rest (the reference runs) is the session's.
    shutil.rmtree(_OWN_STATE if _INHERITED_STATE else _HOST_STATE, ignore_errors=True)
