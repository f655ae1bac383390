"""Lightning under the supervisor (issue 13), on the real dev cluster with the real `lightning`.

examples/lightning_train.py adds ClusteropsCallback, `**trainer_layout()` and
`ckpt_path=resume_path()`. One job on 2 nodes x 1 rank (DDP over gloo; Lightning's own
SLURM environment reads the supervisor's srun step: SLURM_PROCID/SLURM_NTASKS and the
exported MASTER_ADDR/MASTER_PORT) gets rank 1 (not the rank that commits) killed with
kill -9 mid-run, then a preemption; it heals inside the allocation, requeues once,
finishes, and its final weights equal an uninterrupted local 2-rank run's bitwise (the
batch of step s on rank r depends on (s, r) alone; CPU; deterministic algorithms; the
all-reduce of two ranks is a single, commutative addition).
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
SCRIPT = REPO / "examples" / "lightning_train.py"
STEPS = 70
CKPT_EVERY = 10


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.mark.timeout(360)
def test_lightning_kill9_and_preemption_heal_bitwise(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    ref = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(ref / "final.pt")],
                 workdir=ref, script=SCRIPT, one_per_node=True)
    job = fk.TrainJob(root=tmp_path / "lt", name="lt", nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.25, script=SCRIPT)
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
    # Lightning's checkpoints went through clusterops' commit: manifests, hashes, kind.
    assert fk.damaged_checkpoints(job.ckpt_dir) == []
    manifests = [ck.read_manifest(p) for _, p in ck.committed_steps(job.ckpt_dir)]
    assert {(m["kind"], m["world_size"]) for m in manifests} == {("lightning", 2)}
    # Lightning's SLURM auto-requeue stayed out of it: no requeue of its own, no hpc checkpoint.
    assert "requeing job" not in job.batch_log()
    assert not list(job.root.rglob("hpc_ckpt_*.ckpt"))
