"""The lead-time signal is a stop request for SDK scripts without a supervisor.

Issue 13: started with the plain `srun` or `torchrun` launcher (no `supervise:`),
examples/train.py used to die of the forwarded SIGUSR1 (its default action). Now
`sdk.install_stop_handlers` takes it as a stop request: the ranks agree, commit a
checkpoint at the current step and exit 0, so the job completes before its limit.
Both jobs run at once (2 nodes each on the 4-node dev cluster) to share the wait.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clusterops import checkpoint as ck
from clusterops import launch

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
ACTIVATE = Path(sys.prefix) / "bin" / "activate"

pytestmark = pytest.mark.integration


def slurm_client():
    from clusterops.slurm import Slurm

    return Slurm.from_environment()


def spec_text(launcher: str, ckpt: Path) -> str:
    return textwrap.dedent(f"""
        name: lead-{launcher}
        launcher: {launcher}
        nodes: 2
        nproc_per_node: 1
        time: "0:03:00"
        signal_lead_s: 90
        script: {json.dumps(str(TRAIN))}
        args: [--steps, 1000000, --ckpt-every, 0, --step-sleep, 0.05]
        env:
          OMP_NUM_THREADS: "1"
          CLUSTEROPS_CKPT_DIR: {json.dumps(str(ckpt))}
        setup:
          - source {json.dumps(str(ACTIVATE))}
    """).lstrip()


@pytest.mark.timeout(330)
def test_lead_time_signal_saves_and_stops_under_srun_and_torchrun(cluster, tmp_path):
    slurm = slurm_client()
    jobs = {}
    for launcher in ("srun", "torchrun"):
        d = tmp_path / launcher
        d.mkdir()
        (d / "job.yaml").write_text(spec_text(launcher, d / "ckpt"))
        spec = launch.load_spec(d / "job.yaml", [f"log_dir={d / 'logs'}"])
        assert spec.signal_lead_s == 90 and spec.supervise is None
        jobs[launcher] = (d, launch.submit(spec, slurm).job_id)

    deadline = time.monotonic() + 290
    pending = dict(jobs)
    tasks = {}
    while pending and time.monotonic() < deadline:
        for launcher, (d, job_id) in list(pending.items()):
            t = slurm.job_tasks(job_id)
            if t and all(x.category in ("done", "failed") for x in t):
                tasks[launcher] = t
                del pending[launcher]
        time.sleep(1)
    assert not pending, f"jobs not done in time: {pending}"

    for launcher, (d, job_id) in jobs.items():
        logs = "\n".join(p.read_text() for p in sorted((d / "logs").glob("*.out")))
        info = tasks[launcher][0]
        # Stopped on the signal and saved: COMPLETED before the limit, not TIMEOUT or killed.
        assert info.state == "COMPLETED", (launcher, info, logs[-3000:])
        stopped = re.findall(r"^stopped step=(\d+) path=(\S+) reason=(\S+)$", logs, re.M)
        assert len(stopped) == 1, (launcher, logs[-3000:])  # rank 0 says it, once
        step, path, reason = int(stopped[0][0]), Path(stopped[0][1]), stopped[0][2]
        assert reason == "SIGUSR1", (launcher, stopped)
        assert "done step=" not in logs
        assert "SIGUSR1 received; forwarding it to the job step" in logs
        latest = ck.find_latest_good(d / "ckpt", deep=True).latest
        assert latest is not None and latest.path == path, (launcher, path)
        info_ck = ck.verify(path, deep=True)
        assert info_ck.ok and ck.read_manifest(path)["step"] == step > 0
        assert ck.read_manifest(path)["world_size"] == 2
