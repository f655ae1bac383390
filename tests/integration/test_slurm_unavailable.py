"""A controller that stops answering: bounded retries, a one-line error, no traceback, no hang."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_stopped_controller_gives_a_clear_error_in_bounded_time(cluster):
    ctld = cluster.daemon_pids()["slurmctld"]
    env = dict(os.environ, CLUSTEROPS_SLURM_TIMEOUT_S="2", CLUSTEROPS_SLURM_READ_ATTEMPTS="2")
    os.kill(ctld, signal.SIGSTOP)
    try:
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "clusterops", "slurm", "nodes"], capture_output=True,
                           text=True, env=env, timeout=60)
        took = time.monotonic() - t
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: Slurm did not answer after 2 attempts")
    assert "timed out after 2s" in lines[0]
    assert took < 20
    # And it answers again once the controller is back.
    r = subprocess.run([sys.executable, "-m", "clusterops", "slurm", "nodes", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "node1" in r.stdout
