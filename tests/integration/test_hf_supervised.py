"""The Hugging Face Trainer under the supervisor (issue 13): real dev cluster, real `transformers`.

examples/hf_train.py adds ClusteropsTrainerCallback and `resume_from_checkpoint=resume_path()`.
One job on 2 nodes x 1 rank (DDP over gloo; importing the integration gives each srun
task the RANK/WORLD_SIZE/LOCAL_RANK the Trainer reads, the rendezvous is the
supervisor's MASTER_ADDR/MASTER_PORT) gets rank 1 (not the rank that commits) killed
with kill -9 mid-run, then a preemption; it heals inside the allocation, requeues once,
finishes, and its final weights equal an uninterrupted local 2-rank run's bitwise (the
Trainer seeds its data order and skips the batches already seen after a resume; CPU;
full_determinism). No hub: HF_HUB_OFFLINE=1, the model and data are built in the script.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from support import faultkit as fk
from clusterops import checkpoint as ck
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "hf_train.py"
STEPS = 70
CKPT_EVERY = 10


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.mark.timeout(360)
def test_hf_trainer_kill9_and_preemption_heal_bitwise(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    ref = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(ref / "final.pt")],
                 workdir=ref, script=SCRIPT, one_per_node=True)
    job = fk.TrainJob(root=tmp_path / "hf", name="hf", nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.25, script=SCRIPT,
                      spec_extra={"env": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    job.submit()

    job.wait_step(15)
    assert job.signal_rank(1, signal.SIGKILL)              # kill -9 rank 1 (not the one that commits)
    job.wait_step(35, attempt=1)
    slurm.signal(job.job_id, "TERM", full=True)           # what preemption does
    info = job.wait_end(slurm, timeout_s=280)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert events(job, "done"), story
    assert fk.same_weights(job.out, ref / "final.pt"), f"final weights differ from an uninterrupted run\n{story}"

    exits = events(job, "step_exit")
    assert exits[0]["cause"] == "rank_killed" and exits[0]["failures"][0]["rank"] == 1, story
    launches = events(job, "launch")
    assert launches[1]["nodes"] == launches[0]["nodes"] and len(launches[0]["nodes"]) == 2, story
    stop = events(job, "stop_requested")
    assert stop and stop[0]["reason"] == "preemption", story
    stopped = events(job, "stopped")[0]
    assert stopped["ckpt_step"] is not None and stopped["ckpt_step"] >= 35, story   # saved on the signal
    assert len(events(job, "requeue")) == 1 and info.restart_count == 1, story
    resumes = [r for r in events(job, "resume") if r.get("step") is not None]
    assert any(r["step"] == stopped["ckpt_step"] for r in resumes), story
    # The Trainer's checkpoints went through clusterops' commit: manifests, hashes, kind.
    assert fk.damaged_checkpoints(job.ckpt_dir) == []
    manifests = [ck.read_manifest(p) for _, p in ck.committed_steps(job.ckpt_dir)]
    assert {(m["kind"], m["world_size"]) for m in manifests} == {("hf", 2)}
    # Each commit holds every rank's part (the barrier before rank 0 moves the files).
    assert all({"rng_state_0.pth", "rng_state_1.pth"} <= {f.name for f in p.iterdir()}
               for _, p in ck.committed_steps(job.ckpt_dir)), story
    # The Trainer's own checkpoint directories were moved into the commits, none left behind.
    assert not list(job.ckpt_dir.glob("hf-out/checkpoint-*"))
