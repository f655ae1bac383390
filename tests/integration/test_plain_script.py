"""A script without the SDK, healed by the supervisor (issue 13), on the real dev cluster.

examples/plain_train.py imports nothing from clusterops: it prints `step=N`, writes
`ckpt_<step>.pt` with torch.save (temp name, then rename), resumes from `--resume`,
and saves and exits 0 on SIGUSR1/SIGTERM. The spec's `supervise:` section says how to
read it (progress regex, checkpoint glob, resume args). One job gets a rank killed
with kill -9 mid-run, then a preemption; it heals, finishes, and its final weights
equal an uninterrupted run of the same world size bitwise.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLAIN = REPO / "examples" / "plain_train.py"
STEPS = 80
CKPT_EVERY = 10


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.mark.timeout(300)
def test_plain_script_kill9_and_preemption_heal_bitwise(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    ref = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", str(ref / "ck"),
                     "--out", str(ref / "final.pt")], workdir=ref, script=PLAIN)
    job = fk.TrainJob(root=tmp_path / "plain", name="plain", nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.25, script=PLAIN,
                      supervise={"progress": {"regex": r"step[= ](\d+)"}, "checkpoint_glob": "ckpt_*.pt",
                                 "resume_args": ["--resume", "{ckpt}"]})
    job.train_args = ["--ckpt-dir", str(job.ckpt_dir)]
    job.submit()

    job.wait_step(15)
    assert job.signal_rank(1, signal.SIGKILL)              # kill -9 one rank
    job.wait_step(35, attempt=1)
    slurm.signal(job.job_id, "TERM", full=True)           # what preemption does
    info = job.wait_end(slurm, timeout_s=240)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert events(job, "done"), story
    assert fk.same_weights(job.out, ref / "final.pt"), f"final weights differ from an uninterrupted run\n{story}"

    exits = events(job, "step_exit")
    assert exits[0]["cause"] == "rank_killed" and exits[0]["failures"][0]["rank"] == 1, story
    stop = events(job, "stop_requested")
    assert stop and stop[0]["reason"] == "preemption", story
    stopped = events(job, "stopped")[0]
    assert stopped["ckpt_step"] is not None and stopped["ckpt_step"] >= 35, story   # saved on the signal
    assert len(events(job, "requeue")) == 1 and info.restart_count == 1, story
    # Progress came from the output: the supervisor's heartbeat files follow `step=N`.
    beats = [r["max_step"] for r in events(job, "progress")]
    assert beats and max(beats) >= 35, story
    # Restarts added the resume args with the newest complete checkpoint (the script's own file).
    attempts = sorted(job.job_dir.glob("attempt-*/command.txt"), key=lambda p: int(p.parent.name.split("-")[1]))
    commands = [p.read_text().splitlines()[0] for p in attempts]
    resumed = [c for c in commands if "--resume" in c]
    assert len(resumed) >= 2 and all("ckpt_" in c and ".pt" in c for c in resumed), commands
    resumes = [r for r in events(job, "resume") if r.get("step") is not None]
    assert any(r["step"] == stopped["ckpt_step"] and Path(r["path"]).name.startswith("ckpt_")
               for r in resumes), story
