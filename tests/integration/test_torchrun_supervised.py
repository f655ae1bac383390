"""torchrun under the supervisor (issue 13), on the real dev cluster.

`launcher: torchrun` with `supervise:` runs one torchrun agent per node (an srun task),
static rendezvous on the step's first node, `--max-restarts=0` (the supervisor
restarts). examples/train.py (the SDK) on 2 nodes x 1 worker: one worker is killed
with kill -9 mid-run (its agent fails the step), then a preemption; the job heals,
finishes, and its final weights equal an uninterrupted run's bitwise.
"""

from __future__ import annotations

import os
import signal

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 80
CKPT_EVERY = 10


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


def worker_pids(job, rank: int):
    """The torchrun worker of a rank (RANK=<rank> in its environment), not its agent, of this
    job on this test process's cluster (``rank_pids``: another worker's cluster on this host
    runs a job with the same id)."""
    out = []
    for pid in job.rank_pids(rank):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:      # the agent has none (the supervisor unsets it)
            out.append(pid)
    return out


@pytest.mark.timeout(360)
def test_torchrun_kill9_worker_and_preemption_heal_bitwise(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    ref = tmp_path / "ref"
    out_ref = ref / "final.pt"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0",
                     "--out", str(out_ref)], workdir=ref)
    job = fk.TrainJob(root=tmp_path / "tr", name="tr", nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.2, spec_extra={"launcher": "torchrun", "nproc_per_node": 1})
    job.submit()

    job.wait_step(15)
    victims = worker_pids(job, 1)
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)                    # kill -9 one worker, its agent stays
    job.wait_step(35, attempt=1)
    slurm.signal(job.job_id, "TERM", full=True)           # what preemption does
    info = job.wait_end(slurm, timeout_s=280)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert events(job, "done"), story
    assert fk.same_weights(job.out, out_ref), f"final weights differ from an uninterrupted run\n{story}"
    launches = events(job, "launch")
    commands = sorted(job.job_dir.glob("attempt-*/command.txt"))
    first = commands[0].read_text()
    assert "torch.distributed.run" in first and "--ntasks-per-node=1" in first, first
    exits = events(job, "step_exit")
    assert exits[0]["cause"] == "program_error" and exits[0]["blamed"] in ([], ["node2"]), story
    stop = events(job, "stop_requested")
    assert stop and stop[0]["reason"] == "preemption", story
    # The workers got SIGTERM from Slurm and from their agent; they saved at the current
    # step before the agent's close timeout, and the step ended 0.
    stopped = events(job, "stopped")[0]
    assert stopped["returncode"] == 0 and stopped["ckpt_step"] is not None and stopped["ckpt_step"] >= 35, story
    later = [r for r in events(job, "resume") if r["incarnation"] == 1]
    assert later and later[0]["step"] == stopped["ckpt_step"], story
    assert len(events(job, "requeue")) == 1 and info.restart_count == 1, story
    assert len(launches) == 3, story
