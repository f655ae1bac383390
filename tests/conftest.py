"""Shared test fixtures.

The ``devcluster`` fixture brings up one real 4-node Slurm cluster (4 counted GPUs
per node) for the whole session, on ports picked free for this run, and points
SLURM_CONF at it. ``cluster`` is the per-test handle: after each test it cancels
leftover jobs, restarts stopped slurmds and resumes drained nodes so tests do not
leak state into each other.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

DEV_NODES = 4
DEV_GPUS = 4


def _ports_free(base: int, count: int) -> bool:
    for port in range(base, base + count + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def pick_port_base(count: int) -> int:
    env = os.environ.get("CLUSTEROPS_TEST_PORT_BASE")
    if env:
        return int(env)
    rng = random.Random()
    for _ in range(50):
        # Below the kernel's ephemeral range (32768+), where client sockets come and go.
        base = rng.randrange(20000, 32000, 100)
        if _ports_free(base, count):
            return base
    raise RuntimeError("no free port range for the dev cluster")


@pytest.fixture(scope="session")
def devcluster():
    from clusterops.devcluster import DevCluster, DevClusterConfig

    state = Path(tempfile.mkdtemp(prefix="clusterops-test-dc-"))
    dc = DevCluster(state)
    # CLUSTEROPS_SLURM_PREFIX=/opt/slurm-25.11 runs the whole session on that Slurm.
    prefix = os.environ.get("CLUSTEROPS_SLURM_PREFIX") or None
    cfg = DevClusterConfig(nodes=DEV_NODES, gpus_per_node=DEV_GPUS, cpus_per_node=2,
                           port_base=pick_port_base(DEV_NODES), slurm_prefix=prefix)
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

    wait_for(idle, 60, "the dev cluster back to 4 idle nodes", interval_s=0.5,
             detail=lambda: str(dc.node_states()))


@pytest.fixture
def cluster(devcluster):
    """The shared dev cluster, restored to a clean state after the test."""
    _restore(devcluster)
    yield devcluster
    _restore(devcluster)


# A real PostgreSQL server (session) and a fresh history database per backend (per test).
from support.pgserver import history_target, postgres_server  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """The device tiers are deselected (not skipped: they are not in the CPU suite's count)
    unless the -m expression names them: ``-m gpu`` (NVIDIA), ``-m rocm`` (AMD)."""
    expr = config.option.markexpr or ""
    tiers = [t for t in ("gpu", "rocm") if t not in expr]
    if not tiers:
        return
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(t) for t in tiers) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
