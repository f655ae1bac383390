"""An unchanged env:// DDP script under both launch paths, on the real dev cluster (issue 18).

examples/plain_env_ddp.py is what a new user brings: plain torch, ``init_process_group("gloo")``
with no arguments (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment),
LOCAL_RANK read by hand, its own checkpoints. It runs on 2 nodes x 2 ranks from the srun
template as it is (unsupervised), and then under ``supervise:`` (progress regex,
``checkpoint_glob``, ``resume_args``) with one rank killed by kill -9: the supervisor
relaunches it from the script's own checkpoint and it finishes with the same weights,
bitwise, as the unsupervised run. Both runs record each rank's env:// variables, which
must be torch's whole contract, from that task's own Slurm values. The script imports
torch.distributed.nn before its group, so its group is freed when it leaves and no gloo
worker is left to abort a rank at exit (docs/supervisor.md, "A rank that aborts at exit"):
both jobs must end COMPLETED.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "plain_env_ddp.py"
NODES, PPN = 2, 2
STEPS, CKPT_EVERY = 60, 10


def check_rank_env(record_dir: Path, master_port: str = None) -> list:
    """Every rank had RANK..NODE_RANK from its own task, and one rendezvous address."""
    recs = [json.loads((record_dir / f"rank{r}.json").read_text()) for r in range(NODES * PPN)]
    for r, rec in enumerate(recs):
        assert rec["RANK"] == str(r) == rec["slurm_procid"] and rec["dist_rank"] == r, rec
        assert rec["WORLD_SIZE"] == str(NODES * PPN) and rec["dist_world"] == NODES * PPN, rec
        assert rec["LOCAL_RANK"] == str(r % PPN) and rec["LOCAL_WORLD_SIZE"] == str(PPN), rec
        assert rec["NODE_RANK"] == str(r // PPN) == rec["slurm_nodeid"], rec
    assert len({(rec["MASTER_ADDR"], rec["MASTER_PORT"]) for rec in recs}) == 1, recs
    assert all(rec["MASTER_ADDR"] and rec["MASTER_PORT"] for rec in recs), recs
    if master_port is not None:
        assert recs[0]["MASTER_PORT"] == master_port, recs
    return recs


def wait_job(slurm, job_id: int, timeout_s: float, logs: Path):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = slurm.job(job_id)
        except Exception:   # a flaky controller: ask again
            info = None
        if info is not None and info.category in ("done", "failed"):
            return info
        if time.monotonic() > deadline:
            text = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(logs.glob("*.out")))
            raise AssertionError(f"job {job_id} not done after {timeout_s}s: {info}\n{text}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def unsupervised(devcluster, tmp_path_factory):
    """The script launched by the srun template as it is: no supervise:, no SDK."""
    from clusterops import launch
    from clusterops.slurm.factory import connect

    root = tmp_path_factory.mktemp("plain-env-unsupervised")
    spec = launch.JobSpec.from_dict({
        "name": "plain-env", "launcher": "srun", "nodes": NODES, "nproc_per_node": PPN, "time": "0:05:00",
        "script": str(SCRIPT), "python": sys.executable, "workdir": str(root), "log_dir": str(root / "logs"),
        "env": {"OMP_NUM_THREADS": "1"}, "signal_lead_s": 0,
        "args": ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--ckpt-dir", str(root / "ckpt"),
                 "--out", str(root / "final.pt"), "--env-record", str(root / "env")],
    })
    slurm = connect()
    result = launch.submit(spec, slurm)
    info = wait_job(slurm, result.job_id, 180, root / "logs")
    return root, info


@pytest.mark.timeout(240)
def test_env_script_unsupervised_gets_torch_env(cluster, unsupervised):
    root, info = unsupervised
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((root / "logs").glob("*.out")))
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info}\n{logs}"
    assert (root / "final.pt").is_file(), logs
    check_rank_env(root / "env")


@pytest.mark.timeout(420)
def test_env_script_supervised_kill9_resumes_and_finishes_bitwise(cluster, unsupervised, tmp_path):
    """Before issue 18 every attempt died: "environment variable RANK expected, but not set"."""
    from clusterops.slurm.factory import connect

    ref_root, ref_info = unsupervised
    ref_logs = "\n".join(p.read_text(errors="replace") for p in sorted((ref_root / "logs").glob("*.out")))
    assert ref_info.state == "COMPLETED", f"{ref_info}\n{ref_logs[-4000:]}"
    slurm = connect()
    job = fk.TrainJob(root=tmp_path / "sup", name="plain-env-sup", nodes=NODES, steps=STEPS,
                      ckpt_every=CKPT_EVERY, step_sleep=0.2, script=SCRIPT,
                      spec_extra={"nproc_per_node": PPN},
                      supervise={"progress": {"regex": r"step=(\d+)"}, "checkpoint_glob": "ckpt_*.pt",
                                 "resume_args": ["--resume", "{ckpt}"], "max_restarts": 3})
    env_dir = job.root / "env"
    job.train_args = ["--ckpt-dir", str(job.ckpt_dir), "--env-record", str(env_dir)]
    job.submit()

    job.wait_step(15, timeout_s=180)
    first = check_rank_env(env_dir)
    assert job.signal_rank(1, signal.SIGKILL)                  # kill -9 one rank
    info = job.wait_end(slurm, timeout_s=300)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert job.timeline_events("done"), story

    exits = job.timeline_events("step_exit")
    assert exits[0]["cause"] == "rank_killed" and exits[0]["failures"][0]["rank"] == 1, story
    # The relaunch resumed from the script's own newest checkpoint, through resume_args.
    resumes = [r for r in job.timeline_events("resume") if r.get("step") is not None]
    assert resumes and Path(resumes[-1]["path"]).name.startswith("ckpt_") and resumes[-1]["step"] >= 10, story
    command = (job.job_dir / "attempt-1" / "command.txt").read_text().splitlines()
    assert "--resume" in command[0] and "ckpt_" in command[0], command
    # The second attempt's ranks had the whole contract too, with that attempt's rendezvous.
    port = next(line.split("=", 1)[1] for line in command[1:] if line.startswith("MASTER_PORT="))
    second = check_rank_env(env_dir, master_port=port)
    assert second[1]["pid"] != first[1]["pid"]
    assert fk.same_weights(job.out, ref_root / "final.pt"), f"final weights differ from the unsupervised run\n{story}"
