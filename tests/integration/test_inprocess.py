"""In-process recovery (issue 20) on the real dev cluster: examples/train_recoverable.py through
``clusterops.recover.run`` under ``supervise: inprocess:``, 4 nodes x 1 rank + 1 warm standby
per node, real faults (a rank SIGKILLs or SIGSTOPs itself mid-run).

- kill -9 of a rank: the standby on its node takes rank 2 over in the same step (one launch,
  no restart), the state comes from a survivor at the step of the fault (0 steps lost), and
  the final weights equal an uninterrupted run's bitwise.
- SIGSTOP of a rank: its node's standby sees it stopped, the supervisor has it killed, the
  same in-process path heals it.
- the same rank lost a second time: the rendezvous falls back, the supervisor relaunches the
  step (resume from the last checkpoint) and the run still ends bitwise equal.
- a used standby refilled: 2 nodes x 2 ranks, rank 2 then rank 3 (both on node2) SIGKILLed;
  after the first heal the supervisor starts a new standby on node2 (a step of its own,
  ``srun --overlap``), which takes the second lost rank: both heal in-process, bitwise.
- a node lost as a power cut loses it, with a spare: the spare's warm standby takes its rank
  in-process (the node counted lost when its standby stops beating), 0 steps lost, and Slurm
  marking the node down later ends nothing (the step runs with ``--no-kill``), bitwise.
- the batch host lost as a power cut loses it (supervisor and rendezvous with it): a surviving
  rank requeues the job, the next incarnation resumes from the latest checkpoint, bitwise.
"""

from __future__ import annotations

import time

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 60
CKPT_EVERY = 10
SCRIPT = fk.REPO / "examples" / "train_recoverable.py"


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = tmp_path_factory.mktemp("ref")
    out = ref / "final.pt"
    fk.run_local(4, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(out)], workdir=ref,
                 script=SCRIPT)
    return out


def run_job(tmp_path, name, train_args, inprocess=None, nodes=4, step_sleep=0.1, spec_extra=None):
    from clusterops.slurm.factory import connect

    job = fk.TrainJob(root=tmp_path / name, name=name, nodes=nodes, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=step_sleep, script=SCRIPT, train_args=train_args,
                      supervise={"inprocess": inprocess or {"standbys_per_node": 1}}, spec_extra=spec_extra or {})
    job.submit()
    info = job.wait_end(connect(), timeout_s=400)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    return job, story


@pytest.mark.timeout(600)
def test_kill9_heals_in_process_zero_steps_lost_bitwise(cluster, tmp_path, reference):
    job, story = run_job(tmp_path, "ipk", ["--crash-at-step", "23", "--crash-rank", "2",
                                            "--crash-marker", str(tmp_path / "crashed")])
    assert (tmp_path / "crashed").exists(), story
    assert len(events(job, "launch")) == 1 and not events(job, "restart"), story
    rdzv = events(job, "inproc_rendezvous")
    assert len(rdzv) == 1, story
    # The survivors were at the step of the fault: that is where the new generation starts.
    assert rdzv[0]["step"] == 23 and [m["rank"] for m in rdzv[0]["replaced"]] == [2], story
    assert rdzv[0]["replaced"][0]["from"] == rdzv[0]["replaced"][0]["to"] == "node3", story
    first = events(job, "inproc_first_step")
    assert len(first) == 1 and first[0]["step"] == 24, story
    assert events(job, "inproc_state") and not events(job, "inproc_fallback"), story
    assert events(job, "done"), story
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"


@pytest.mark.timeout(600)
def test_sigstop_is_killed_by_its_node_and_heals_in_process(cluster, tmp_path, reference):
    job, story = run_job(tmp_path, "ips", ["--hang-at-step", "17", "--crash-rank", "1",
                                            "--crash-marker", str(tmp_path / "stopped")])
    assert len(events(job, "launch")) == 1 and not events(job, "restart"), story
    fault = events(job, "inproc_fault")
    assert len(fault) == 1 and "hung" in fault[0]["first"], story
    rdzv = events(job, "inproc_rendezvous")
    assert len(rdzv) == 1 and rdzv[0]["step"] == 17 and rdzv[0]["replaced"][0]["rank"] == 1, story
    assert events(job, "inproc_first_step"), story
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"


@pytest.mark.timeout(600)
def test_same_rank_lost_twice_falls_back_to_relaunch_bitwise(cluster, tmp_path, reference):
    job, story = run_job(tmp_path, "ip2", ["--crash-at-step", "15", "--crash-rank", "2",
                                            "--crash-marker", str(tmp_path / "c1"),
                                            "--second-crash-at-step", "27",
                                            "--second-crash-marker", str(tmp_path / "c2")])
    assert (tmp_path / "c1").exists() and (tmp_path / "c2").exists(), story
    assert len(events(job, "inproc_first_step")) == 1, story          # the first fault healed in-process
    fb = events(job, "inproc_fallback")
    assert len(fb) == 1 and "second time" in fb[0]["reason"], story   # the second one did not
    assert len(events(job, "launch")) == 2 and events(job, "restart"), story
    resumes = events(job, "resume")
    assert resumes and resumes[-1]["step"] == 20, story               # the relaunch resumed from disk
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"


@pytest.mark.timeout(600)
def test_refilled_standby_heals_a_second_fault_on_the_same_node_bitwise(cluster, tmp_path, reference):
    """2 nodes x 2 ranks + 1 standby a node (3 tasks on the dev cluster's 2-CPU nodes: the
    allocation asks one task a node with --overcommit, the steps --overcommit), world 4 as the
    reference. Rank 2 (node2) SIGKILLs itself at step 15: node2's
    standby takes it, and once the new generation trains the supervisor starts a new standby
    on node2. Rank 3 (node2 too) SIGKILLs itself at step 45: the new standby takes it (node1's
    standby stays unused). Two heals in one launch, no relaunch, bitwise equal."""
    job, story = run_job(tmp_path, "ipr", ["--crash-at-step", "15", "--crash-rank", "2",
                                            "--crash-marker", str(tmp_path / "c1"),
                                            "--second-crash-at-step", "45", "--second-crash-rank", "3",
                                            "--second-crash-marker", str(tmp_path / "c2")],
                         nodes=2, step_sleep=0.5,
                         spec_extra={"nproc_per_node": 2, "srun_args": ["--overcommit"],
                                     # after the launcher's --ntasks-per-node=3, which 2 CPUs refuse
                                     "sbatch_args": ["--overcommit", "--ntasks-per-node=1"]})
    assert (tmp_path / "c1").exists() and (tmp_path / "c2").exists(), story
    assert len(events(job, "launch")) == 1 and not events(job, "restart"), story
    assert not events(job, "inproc_fallback"), story
    rdzv = events(job, "inproc_rendezvous")
    assert [r["step"] for r in rdzv] == [15, 45], story
    assert [[(m["rank"], m["from"], m["to"]) for m in r["replaced"]] for r in rdzv] == [
        [(2, "node2", "node2")], [(3, "node2", "node2")]], story
    refill, warm = events(job, "inproc_refill"), events(job, "inproc_standby")
    assert refill and refill[0]["node"] == "node2" and warm and warm[0]["node"] == "node2", story
    # The second fault's replacement is the standby started after the first (not a step task).
    assert rdzv[1]["replaced"][0]["uid"] == warm[0]["uid"] and warm[0]["t"] < rdzv[1]["t"], story
    assert len(events(job, "inproc_first_step")) == 2 and events(job, "done"), story
    rep = tl.goodput_report(job.timeline())
    assert rep["inprocess"]["recoveries"] == 2 and rep["lost_s"]["inprocess"] > 0, story
    assert rep["restarts"] == 0, story
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"


@pytest.mark.timeout(600)
def test_node_lost_with_a_spare_heals_in_process_on_the_spare_bitwise(cluster, tmp_path):
    """node3 taken away as a power cut does it (its slurmd, slurmstepds and processes SIGKILLed
    at once) with a spare present. The spare runs a warm standby (a step of its own); node3's
    standby stops beating, so the rendezvous counts the node lost whole within seconds and
    gives rank 2 to the spare's standby, with the state of a survivor: one launch, 0 steps
    lost. The training step runs with --no-kill, so when Slurm marks node3 down (SlurmdTimeout
    later) the step goes on and the supervisor only records (and drains) the node."""
    from clusterops.slurm.factory import connect

    ref = tmp_path / "ref3"
    out_ref = ref / "final.pt"
    fk.run_local(3, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(out_ref)], workdir=ref,
                 script=SCRIPT)
    job = fk.TrainJob(root=tmp_path / "ipn", name="ipn", nodes=3, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.8, script=SCRIPT, supervise={"inprocess": {"standbys_per_node": 1},
                                                                "spare_nodes": 1})
    job.submit()
    job.wait_step(20, timeout_s=300)
    assert [r["nodes"] for r in events(job, "inproc_spares")] == [["node4"]], tl.format_text(job.timeline())
    killed_at = time.time()
    cluster.kill_node("node3", power_cut=True)
    info = job.wait_end(connect(), timeout_s=400)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert len(events(job, "launch")) == 1 and not events(job, "restart"), story
    assert not events(job, "inproc_fallback"), story
    lost = events(job, "inproc_node_lost")
    assert len(lost) == 1 and lost[0]["node"] == "node3", story
    rdzv = events(job, "inproc_rendezvous")
    assert len(rdzv) == 1 and [(m["rank"], m["from"], m["to"]) for m in rdzv[0]["replaced"]] == [
        (2, "node3", "node4")], story
    first = events(job, "inproc_first_step")
    # 0 steps lost: the new generation goes on from the survivors' step at the fault.
    assert len(first) == 1 and first[0]["step"] == rdzv[0]["step"] + 1, story
    assert events(job, "spare_used")[0]["nodes"] == ["node4"], story
    # Slurm's own word came later and ended nothing (the SlurmdTimeout, excluded from the heal).
    down = events(job, "node_down")
    assert down and down[0]["node"] == "node3", story
    print(f"kill -> healed (first step) {first[0]['at'] - killed_at:.2f} s; "
          f"kill -> Slurm's node_down {down[0]['t'] - killed_at:.1f} s; fault_to_step_s {first[0]['fault_to_step_s']}")
    assert fk.same_weights(job.out, out_ref), f"final weights differ from an uninterrupted run\n{story}"


@pytest.mark.timeout(600)
def test_batch_host_lost_in_process_ranks_requeue_resumed_bitwise(cluster, tmp_path):
    """The batch host (node1: the supervisor and the rendezvous it hosts, rank 0, its standby)
    taken away as a power cut takes it, under in-process recovery: no rendezvous is left to
    heal in-process, so the surviving ranks and standbys must not die holding the job; a
    surviving rank hears no beacon and requeues it, and the next incarnation resumes from
    the latest checkpoint, bitwise."""
    from clusterops.slurm.factory import connect

    slurm = connect()
    ref = tmp_path / "ref3"
    out_ref = ref / "final.pt"
    fk.run_local(3, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(out_ref)], workdir=ref,
                 script=SCRIPT)
    job = fk.TrainJob(root=tmp_path / "ipb", name="ipb", nodes=3, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.2, script=SCRIPT, supervise={"inprocess": {"standbys_per_node": 1}})
    job.submit(env={"CLUSTEROPS_SUPERVISOR_LOST_S": "3"})
    job.wait_step(20, timeout_s=300)
    # The cut comes after the step-20 checkpoint committed (a step reported is not yet a
    # checkpoint saved: rank 0 commits it, and the cut takes rank 0).
    fk.wait_for(lambda: (job.ckpt_dir / "step_00000020").is_dir(), 60, "the step-20 checkpoint")
    assert slurm.job(job.job_id).batch_host == "node1"
    cluster.kill_node("node1", power_cut=True)
    info = job.wait_end(slurm, timeout_s=400)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert events(job, "supervisor_lost") and info.restart_count == 1, story
    resumed = [r for r in events(job, "resume") if r["incarnation"] == 1]
    assert resumed and resumed[0]["step"] >= 20, story
    assert fk.same_weights(job.out, out_ref), f"final weights differ from an uninterrupted run\n{story}"
