"""SlurmFanout's plumbing, driven by a fake Slurm and a fake clock (no cluster, well under
a second each).

The fake Slurm (tests/support/fakes.py ``SweepSlurm``) does what the real one would, seen
from the sweep: ``submit`` takes the check script and pinned ``--nodelist``, hands out job
ids, and, once the fake clock reaches a node's scripted answer time, leaves the files the
real check script leaves (``<jobid>.json``, ``.err``, then ``.done``); ``jobs`` answers the
batched squeue with each job's scripted state; ``cancel`` records. The fake clock advances only when the
fan-out sleeps. The real-Slurm version of these paths is tests/integration/test_sweep_slurm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops.slurm.parse import NodeInfo
from clusterops.sweep import (EXIT_OK, EXIT_UNHEALTHY, SlurmFanout, SweepOptions, Target, run_sweep)
from clusterops.sweep.scripts import check_script, pair_script
from support.fakes import PairSlurm, SweepSlurm as FakeSlurm

PASS_DOC = {"node": "?", "profile": "fast", "status": "pass", "exit_code": 0, "duration_s": 0.4,
            "results": [{"name": "host.memory", "status": "pass", "value": 12.0, "unit": "GB", "detail": "ok"}]}
FAIL_DOC = {"node": "?", "profile": "fast", "status": "fail", "exit_code": 1, "duration_s": 0.4,
            "results": [{"name": "host.paths", "probe": "host.paths", "status": "fail",
                         "detail": "/scratch is missing"}]}


class FakeClock:
    """Monotonic seconds that move only when the code under test sleeps."""

    def __init__(self):
        self.now = 0.0
        self.on_sleep = lambda now: None
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        self.on_sleep(self.now)
        time.sleep(0.0005)   # let the submission threads run, as real sleeping would


def fanout(slurm, clock, work, **kw):
    clock.on_sleep = slurm.advance
    kw.setdefault("timeout_s", 20.0)
    return SlurmFanout(slurm, ["clusterops", "health", "check", "--json", "--profile", "fast"], work,
                       poll_s=0.5, squeue_every_s=3.0, end_grace_s=3.0, clock=clock, sleep=clock.sleep, **kw)


def targets(*names):
    return [Target(n, "debug") for n in names]


def test_every_node_answers(tmp_path):
    clock = FakeClock()
    plan = {"node1": ("answer", PASS_DOC, 0, 2.0), "node2": ("answer", PASS_DOC, 0, 4.0),
            "node3": ("answer", FAIL_DOC, 1, 6.0)}
    slurm = FakeSlurm(plan, clock)
    seen = []
    results = fanout(slurm, clock, tmp_path).run(targets("node1", "node2", "node3"), seen.append)

    assert {n: r.status for n, r in results.items()} == {"node1": "pass", "node2": "pass", "node3": "fail"}
    assert sorted(r.node for r in seen) == ["node1", "node2", "node3"]   # progress once per node
    assert results["node3"].probe == "host.paths" and "/scratch is missing" in results["node3"].detail
    assert results["node1"].cpu_s == pytest.approx(0.4)                  # the children's user + sys
    assert 2.0 <= results["node1"].latency_s < 3.0 and 6.0 <= results["node3"].latency_s < 7.0
    assert {r.job_id for r in results.values()} == set(slurm.submitted)
    # One exclusive job pinned to each node, in the partition asked for; nothing cancelled.
    for script, args in slurm.submit_calls:
        assert script == tmp_path / "check.sh"
        assert "--exclusive" in args and "--nodes=1" in args and "--partition=debug" in args
        assert "--no-requeue" in args and "--time=1" in args
    assert slurm.cancelled == []
    # Results come from the files: squeue is asked rarely, and about all jobs at once.
    assert len(slurm.jobs_calls) <= 2 and all(len(c) >= 2 for c in slurm.jobs_calls)
    # The script that ran is the rendered template with the check command in it.
    text = (tmp_path / "check.sh").read_text()
    assert "clusterops health check --json --profile fast" in text and text.startswith("#!/bin/bash\n")


def test_a_node_that_never_answers_is_unreachable_and_its_job_cancelled(tmp_path):
    clock = FakeClock()
    plan = {"node1": ("answer", PASS_DOC, 0, 1.0), "node2": ("hang", "RUNNING"),
            "node3": ("hang", "PENDING")}
    slurm = FakeSlurm(plan, clock)
    results = fanout(slurm, clock, tmp_path, timeout_s=10.0).run(targets("node1", "node2", "node3"))

    assert results["node1"].status == "pass"
    for node in ("node2", "node3"):
        r = results[node]
        assert r.status == "unreachable" and not r.healthy and r.probe == "sweep"
        assert r.job_id in slurm.cancelled
    assert "no result within 10s" in results["node2"].detail
    assert "never started within 10s (Resources)" in results["node3"].detail
    assert sorted(slurm.cancelled) == sorted([results["node2"].job_id, results["node3"].job_id])
    assert 10.0 <= clock.now < 12.0          # gave up at the deadline, not later


def test_a_job_that_ends_without_a_result_is_unreachable_after_the_grace(tmp_path):
    clock = FakeClock()
    plan = {"node1": ("vanish", "FAILED", 2.0), "node2": ("vanish", "gone", 2.0),
            "node3": ("answer", PASS_DOC, 0, 1.0)}
    slurm = FakeSlurm(plan, clock)
    results = fanout(slurm, clock, tmp_path, timeout_s=60.0).run(targets("node1", "node2", "node3"))

    jid1, jid2 = results["node1"].job_id, results["node2"].job_id
    assert results["node1"].status == "unreachable" and f"check job {jid1} ended (FAILED)" in results["node1"].detail
    assert results["node2"].status == "unreachable" and f"check job {jid2} ended (gone)" in results["node2"].detail
    assert results["node3"].status == "pass"
    # Noticed by the batched squeue plus the grace, long before the 60 s deadline; nothing
    # left to cancel.
    assert clock.now < 15.0 and slurm.cancelled == []


def test_a_refused_submission_is_the_sweeps_error_and_the_others_go_on(tmp_path):
    clock = FakeClock()
    plan = {"node1": ("answer", PASS_DOC, 0, 1.0),
            "node2": ("refuse", "Requested node configuration is not available"),
            "node3": ("answer", PASS_DOC, 0, 1.5)}
    slurm = FakeSlurm(plan, clock)
    results = fanout(slurm, clock, tmp_path).run(targets("node1", "node2", "node3"))

    assert results["node1"].status == "pass" and results["node3"].status == "pass"
    r = results["node2"]
    assert r.status == "error" and r.probe == "sweep" and r.job_id is None
    assert r.detail.startswith("submit failed: sbatch: error: Requested node configuration")
    assert not r.checked and not r.failing      # never a reason to drain the node
    assert slurm.cancelled == []


def test_max_running_caps_the_jobs_in_flight(tmp_path):
    clock = FakeClock()
    names = [f"node{i}" for i in range(1, 9)]
    slurm = FakeSlurm({n: ("answer", PASS_DOC, 0, 2.0) for n in names}, clock)
    results = fanout(slurm, clock, tmp_path, max_running=3).run(targets(*names))

    assert sorted(results) == sorted(names) and all(r.status == "pass" for r in results.values())
    assert slurm.in_flight_max <= 3
    # Submission order is the target order.
    assert [next(a for a in args if a.startswith("--nodelist=")) for _s, args in slurm.submit_calls] == \
        [f"--nodelist={n}" for n in names]


def test_an_interrupted_fanout_cancels_its_jobs(tmp_path):
    clock = FakeClock()
    slurm = FakeSlurm({"node1": ("answer", PASS_DOC, 0, 1.0), "node2": ("hang", "RUNNING"),
                       "node3": ("hang", "RUNNING")}, clock)

    def stop(_result):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fanout(slurm, clock, tmp_path, timeout_s=30.0).run(targets("node1", "node2", "node3"), stop)
    hung = [jid for jid, rec in slurm.submitted.items() if rec[0] != "node1"]
    assert sorted(slurm.cancelled) == sorted(hung)


# -- run_sweep over the same fake: busy nodes, drains ---------------------------------------

def _idle(name):
    return NodeInfo(name, "idle", partitions=("debug",))


def test_sweep_skips_and_lists_a_busy_node_and_drains_only_the_failing_one(tmp_path):
    nodes = [_idle("node1"), NodeInfo("node2", "allocated", partitions=("debug",)), _idle("node3"),
             _idle("node4"), _idle("node5")]
    plan = {"node1": ("answer", PASS_DOC, 0, 0.0), "node3": ("answer", FAIL_DOC, 1, 0.0),
            "node4": ("answer", PASS_DOC, 0, 0.0), "node5": ("answer", PASS_DOC, 0, 0.0)}
    slurm = FakeSlurm(plan, nodes=nodes)
    opts = SweepOptions(partition=None, nodes="node[1-5]", drain=True, max_drain_fraction=0.5,
                        timeout_s=30, work_dir=str(tmp_path))
    report = run_sweep(opts, slurm=slurm)

    assert report.targets == ["node1", "node2", "node3", "node4", "node5"]
    busy = report.results["node2"]
    assert busy.status == "skipped" and busy.detail.startswith("busy (allocated)")
    assert all("--nodelist=node2" not in args for _s, args in slurm.submit_calls)   # never disturbed
    assert {n: r.status for n, r in report.results.items() if n != "node2"} == \
        {"node1": "pass", "node3": "fail", "node4": "pass", "node5": "pass"}
    assert slurm.drained == [(["node3"], "clusterops:sweep: host.paths: /scratch is missing")]
    assert slurm.resumed == [] and report.exit_code == EXIT_UNHEALTHY
    doc = report.to_dict()
    assert doc["counts"]["skipped"] == 1 and [a["node"] for a in doc["applied"]] == ["node3"]


def test_sweep_of_healthy_nodes_without_drain_changes_nothing(tmp_path):
    nodes = [_idle("node1"), _idle("node2")]
    slurm = FakeSlurm({"node1": ("answer", PASS_DOC, 0, 0.0), "node2": ("answer", PASS_DOC, 0, 0.0)}, nodes=nodes)
    report = run_sweep(SweepOptions(nodes="node[1-2]", timeout_s=30, work_dir=str(tmp_path)), slurm=slurm)
    assert report.exit_code == EXIT_OK and slurm.drained == [] and slurm.resumed == []
    assert not any(Path(tmp_path).iterdir())     # the sweep's work folder is removed


# -- the generated scripts, run with bash ---------------------------------------------------

def test_check_script_runs_under_bash_with_a_hostile_work_dir(tmp_path):
    work = tmp_path / "it's; a $(dir) `x`"
    work.mkdir()
    cmd = [sys.executable, "-c", "import json,sys; print(json.dumps({'status': 'pass', 'arg': sys.argv[1]}))",
           "quote ' and \" and ; rm -rf /"]
    script = work / "check.sh"
    script.write_text(check_script(work, cmd))
    r = subprocess.run(["bash", str(script)], env={"SLURM_JOB_ID": "42", "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads((work / "42.json").read_text()) == {"status": "pass", "arg": cmd[-1]}
    done = (work / "42.done").read_text().splitlines()
    assert done[0] == "0" and len(done) == 3          # exit code, then `times`
    assert not (work / "42.json.part").exists() and not (work / "42.meta.part").exists()


def test_pair_script_rendezvous_uses_the_node_address_and_runs_the_step(tmp_path):
    """The pair job with stand-ins for scontrol and srun on PATH: the first node's name
    does not resolve, so MASTER_ADDR is its NodeAddr, as Slurm.node_address would say."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        "if [ \"$1 $2\" = 'show hostnames' ]; then printf 'nodeq1\\nnodeq2\\n'; exit 0; fi\n"
        "if [ \"$1 $2\" = 'show node' ]; then echo \"NodeName=$3 Arch=x86_64 NodeAddr=10.9.8.7 NodeHostName=h\"; exit 0; fi\n"
        "exit 1\n")
    (bin_dir / "srun").write_text("#!/bin/bash\necho \"srun $* MASTER_ADDR=$MASTER_ADDR\"\nexit 3\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    pair_dir = tmp_path / "pair dir; 'q'"
    pair_dir.mkdir()
    script = pair_dir / "pair.sh"
    step = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "clusterops", "health", "dist", "--size", "16M"]
    script.write_text(pair_script(pair_dir, step))
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "nodeq[1-2]", "PATH": f"{bin_dir}:/usr/bin:/bin"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = (pair_dir / "7.out").read_text()
    assert out.strip() == ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 clusterops health dist --size 16M "
                           f"--result-dir {pair_dir}/7.d --report {pair_dir}/7.json MASTER_ADDR=10.9.8.7")
    assert (pair_dir / "7.done").read_text().strip() == "3"


def test_pairs_report_each_pair_and_cancel_a_silent_one(tmp_path):
    """--pairs plumbing: healthy nodes paired in name order, one 2-node job per pair; a pair
    that answers is read from its files, a silent one is unreachable and cancelled."""
    from clusterops.sweep import NodeResult, run_pairs

    clock = FakeClock()

    slurm = PairSlurm({"node1,node2": {"busbw_gbps": 1.5, "detail": "ok"}})
    results = {n: NodeResult(n, "pass") for n in ("node10", "node2", "node1", "node3")}
    results["node4"] = NodeResult("node4", "fail")
    errors = []
    out = run_pairs(slurm, results, SweepOptions(timeout_s=5, pairs=True), tmp_path, errors,
                    clock=clock, sleep=clock.sleep)

    by_nodes = {tuple(p["nodes"]): p for p in out}
    assert set(by_nodes) == {("node1", "node2"), ("node3", "node10")}   # node4 failed: not paired
    assert by_nodes[("node1", "node2")]["status"] == "pass" and by_nodes[("node1", "node2")]["busbw_gbps"] == 1.5
    silent = by_nodes[("node3", "node10")]
    assert silent["status"] == "unreachable" and slurm.cancelled == [silent["job_id"]]
    assert errors == [] and 5.0 <= clock.now < 6.0
    for script, args in slurm.submitted.values():
        assert script == tmp_path / "pairs" / "pair.sh" and "--nodes=2" in args and "--exclusive" in args
    text = (tmp_path / "pairs" / "pair.sh").read_text()
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 " in text and " health dist " in text


def test_pairs_carry_ib_write_bw_skip_pass_and_fail(tmp_path):
    """The pair job's ibbw step: a skip (no HCA) leaves the pair as the all-reduce made it,
    a pass is carried with its figure, a fail makes the pair fail; the step runs one task per
    node with the sweep's profile (whose probes.ibbw says GPUDirect or not); a profile that
    turns ibbw off runs no ib step."""
    from clusterops.sweep import NodeResult, run_pairs

    def side(status, gbps=None, detail="", gpudirect=False):
        return {"status": status, "gbps": gbps, "detail": detail, "node": "n", "gpudirect": gpudirect}

    slurm = PairSlurm({
        "node1,node2": {"busbw_gbps": 1.5, "ib": {"server": side("skip", detail="no HCA: nothing under /sys"),
                                                  "client": side("skip", detail="no HCA")}},
        "node3,node4": {"busbw_gbps": 1.5, "ib": {"server": side("pass"),
                                                  "client": side("pass", 393.9, "mlx5_0: 393.9 Gb/s", True)}},
        "node5,node6": {"busbw_gbps": 1.5, "ib": {"server": side("pass"),
                                                  "client": side("fail", 196.1, "mlx5_0: 196.1 Gb/s < floor 380")}},
    })
    results = {f"node{i}": NodeResult(f"node{i}", "pass") for i in range(1, 7)}
    clock = FakeClock()
    out = run_pairs(slurm, results, SweepOptions(timeout_s=5, pairs=True, profile="deep"), tmp_path, [],
                    clock=clock, sleep=clock.sleep)
    by = {tuple(p["nodes"]): p for p in out}
    skip, ok, low = by[("node1", "node2")], by[("node3", "node4")], by[("node5", "node6")]
    assert skip["status"] == "pass" and skip["ib_write_bw"]["status"] == "skip"
    assert "no HCA" in skip["ib_write_bw"]["detail"]
    assert ok["status"] == "pass" and ok["ib_write_bw"]["gbps"] == 393.9 and ok["ib_write_bw"]["gpudirect"]
    assert low["status"] == "fail" and "ib_write_bw" in low["detail"] and "380" in low["detail"]
    text = (tmp_path / "pairs" / "pair.sh").read_text()
    assert "srun --ntasks-per-node=1 --wait=15 " in text and " health ibbw --profile deep" in text
    out = run_pairs(PairSlurm({}), results, SweepOptions(timeout_s=1, pairs=True, profile="fast"),
                    tmp_path / "fast", [], clock=clock, sleep=clock.sleep)
    assert " health ibbw --profile fast" in (tmp_path / "fast" / "pairs" / "pair.sh").read_text()
    assert all(p["ib_write_bw"] is None for p in out)   # silent pairs: unreachable, no ib result
    off = tmp_path / "off.yaml"
    off.write_text("extends: fast\nprobes:\n  ibbw: false\n")
    run_pairs(PairSlurm({}), results, SweepOptions(timeout_s=1, pairs=True, profile=str(off)),
              tmp_path / "off", [], clock=clock, sleep=clock.sleep)
    assert "health ibbw" not in (tmp_path / "off" / "pairs" / "pair.sh").read_text()


def test_pair_script_runs_the_ib_step_after_the_all_reduce(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'nodeq1\\nnodeq2\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/bash\necho \"srun $*\"\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    pair_dir = tmp_path / "p 'x'"
    pair_dir.mkdir()
    script = pair_dir / "pair.sh"
    script.write_text(pair_script(pair_dir, ["srun", "dist"], ib_step=["srun", "--wait=15", "clusterops", "health", "ibbw"]))
    env = {"SLURM_JOB_ID": "8", "SLURM_JOB_NODELIST": "nodeq[1-2]", "PATH": f"{bin_dir}:/usr/bin:/bin"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (pair_dir / "8.ib.out").read_text().strip() == \
        f"srun --wait=15 clusterops health ibbw --report-dir {pair_dir}/8.ib"
    assert (pair_dir / "8.ib").is_dir() and (pair_dir / "8.done").read_text().strip() == "0"
