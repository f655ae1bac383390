"""The Slurm client's retry policy, with a runner stand-in that fails on cue."""

import pytest

from clusterops.errors import InputError, NotFoundError
from clusterops.runner import CommandError, CommandTimeout
from clusterops.slurm import ForeignDrainError, Slurm, SlurmError, SlurmUnavailable
from support.fakes import ScriptedRunner

SQUEUE_EMPTY = '{"jobs": []}'


def client(outcomes, attempts=3):
    sleeps = []
    runner = ScriptedRunner(outcomes)
    return Slurm(runner, read_attempts=attempts, backoff_s=0.1, sleep=sleeps.append), runner, sleeps


def down(argv=("squeue",)):
    return CommandError(list(argv), 1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)")


def test_reads_retry_with_backoff_then_succeed():
    s, runner, sleeps = client([down(), CommandTimeout(["squeue"], 5), SQUEUE_EMPTY])
    assert s.jobs() == []
    assert len(runner.calls) == 3 and sleeps == [0.1, 0.2]


def test_reads_give_up_after_bounded_attempts():
    s, runner, sleeps = client([down(), down(), down()])
    with pytest.raises(SlurmUnavailable) as ei:
        s.jobs()
    assert "after 3 attempts" in str(ei.value) and "connect failure" in str(ei.value)
    assert len(runner.calls) == 3


def test_not_found_is_not_retried():
    err = CommandError(["scontrol"], 1, "slurm_load_jobs error: Invalid job id specified")
    s, runner, _ = client([err])
    with pytest.raises(NotFoundError):
        s.job(42)
    assert len(runner.calls) == 1


def test_writes_are_never_retried_blindly(tmp_path):
    script = tmp_path / "j.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    s, runner, _ = client([down(["sbatch"]), "7\n"])
    with pytest.raises(SlurmError):
        s.submit(script)
    assert len(runner.calls) == 1           # one sbatch, no second submission
    # resume reads the node first (retried), then writes once.
    s2, runner2, _ = client([down(["scontrol"]), node_line("node1", "DRAIN", "clusterops:sweep: x: y"),
                             CommandTimeout(["scontrol"], 5)])
    with pytest.raises(SlurmUnavailable):
        s2.resume("node1")
    assert len(runner2.calls) == 3 and runner2.calls[2][-1] == "State=RESUME"


def node_line(name, state="IDLE", reason=None):
    line = f"NodeName={name} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 State={state} Partitions=debug"
    if reason:
        line += f" Reason={reason} [root@2026-12-01T05:00:00]"
    return line + "\n"


def test_argv_shapes():
    listing = node_line("node1", "IDLE+DRAIN", "clusterops:sweep: xid: Xid 79") + node_line("node3", "DOWN")
    s, runner, _ = client(["", listing, ""])
    s.drain("node[1-2],node4", "clusterops:sweep: xid: Xid 79, GPU fell off the bus")
    s.resume(["node3", "node1"])
    assert runner.calls[0] == ["scontrol", "update", "NodeName=node[1-2,4]", "State=DRAIN",
                               "Reason=clusterops:sweep: xid: Xid 79, GPU fell off the bus"]
    assert runner.calls[1] == ["scontrol", "show", "node", "--oneliner", "node[1,3]"]
    assert runner.calls[2] == ["scontrol", "update", "NodeName=node[1,3]", "State=RESUME"]


def test_resume_refuses_a_foreign_reason_and_resumes_nothing():
    listing = node_line("node1", "IDLE+DRAIN", "clusterops: host.paths: legacy") + \
        node_line("node2", "IDLE+DRAIN", "admin: swap DIMM B3")
    s, runner, _ = client([listing])
    with pytest.raises(ForeignDrainError) as ei:
        s.resume("node[1-2]")
    assert "node2 ('admin: swap DIMM B3')" in str(ei.value) and "node1" not in str(ei.value)
    assert all("State=RESUME" not in c for c in runner.calls)


def test_drain_writes_only_clusterops_reasons():
    s, runner, _ = client([])
    for bad in ("admin: swap DIMM", "", "clusterops:sweep: two\nlines"):
        with pytest.raises(InputError):
            s.drain("node1", bad)
    assert runner.calls == []


def test_jobs_asks_scontrol_for_an_id_squeue_leaves_out():
    # squeue (23.02+ without --states=all, or a job about to be purged) omits job 5;
    # scontrol still has it; job 6 is known to neither and is simply absent.
    squeue = '{"jobs": [{"job_id": 4, "name": "a", "job_state": ["RUNNING"]}]}'
    scontrol5 = "JobId=5 JobName=b JobState=COMPLETED Reason=None Restarts=0 ExitCode=0:0 NodeList=node1\n"
    gone = CommandError(["scontrol"], 1, "slurm_load_jobs error: Invalid job id specified")
    s, runner, _ = client([squeue, scontrol5, gone])
    found = {j.job_id: j for j in s.jobs([4, 5, 6])}
    assert set(found) == {4, 5} and found[5].state == "COMPLETED" and found[5].category == "done"
    assert runner.calls[0][:4] == ["squeue", "--json", "--all", "--states=all"]
    assert runner.calls[1][:3] == ["scontrol", "show", "job"] and runner.calls[1][-1] == "5"
    assert runner.calls[2][-1] == "6"
