"""A dead daemon's pid is soon another process's: the dev cluster never takes that process for
the daemon (a node left unrestarted, ``idle*`` for good) nor signals it (``kill_node``, ``down``).

Real processes throughout: a ``sleep`` stands for the stranger who got the pid. The kernel
cannot be made to reuse a chosen pid here, so the state file records the stranger's pid with the
start time of the process that had it before, which is what a reused pid looks like.
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from clusterops.devcluster import DEVCLUSTER_INFO, DevCluster
from clusterops.runner import pid_alive, process_start


@pytest.fixture
def stranger():
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def test_a_pid_with_its_start_names_one_process(stranger):
    start = process_start(stranger.pid)
    assert isinstance(start, int) and start > 0
    assert pid_alive(stranger.pid) and pid_alive(stranger.pid, start)
    assert not pid_alive(stranger.pid, start - 1)        # the same pid, an earlier process
    stranger.kill()
    stranger.wait()
    assert not pid_alive(stranger.pid, start) and process_start(stranger.pid) is None


def _state(tmp_path, pids, starts=None):
    dc = DevCluster(tmp_path / "dc")
    dc.state.mkdir(parents=True)
    body = {"config": {}, "pids": pids, "started": 0}
    if starts is not None:
        body["starts"] = starts
    (dc.state / DEVCLUSTER_INFO).write_text(json.dumps(body))
    return dc


def test_a_reused_pid_is_not_the_daemon_and_is_never_signalled(tmp_path, stranger):
    before = process_start(stranger.pid) - 1            # the dead slurmd's start; its pid now the stranger's
    dc = _state(tmp_path, {"slurmd:node3": stranger.pid, "slurmctld": stranger.pid},
                {"slurmd:node3": before, "slurmctld": process_start(stranger.pid)})
    assert dc.daemon_pids() == {"slurmd:node3": None, "slurmctld": stranger.pid}
    assert dc.kill_node("node3") == []                   # nothing to kill: the node's slurmd is gone
    assert stranger.poll() is None
    assert not dc.status()["daemons"]["slurmd:node3"]["alive"]
    assert not dc.running()


def test_down_signals_only_its_own_daemons(tmp_path, stranger):
    dc = _state(tmp_path, {"slurmd:node1": stranger.pid}, {"slurmd:node1": process_start(stranger.pid) + 7})
    assert stranger.pid not in dc.down(timeout_s=1)
    assert stranger.poll() is None
    assert json.loads((dc.state / DEVCLUSTER_INFO).read_text())["pids"] == {}


def test_a_state_file_without_start_times_is_read_by_pid(tmp_path, stranger):
    dc = _state(tmp_path, {"slurmd:node1": stranger.pid})
    assert dc.daemon_pids() == {"slurmd:node1": stranger.pid}
    stranger.send_signal(signal.SIGKILL)
    stranger.wait()
    assert dc.daemon_pids() == {"slurmd:node1": None}
