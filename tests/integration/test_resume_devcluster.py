"""Exact resume with srun-native ranks on the real 4-node dev cluster.

4 ranks (one per node) started by srun, rendezvous through MASTER_ADDR/MASTER_PORT as
a launcher exports them, gloo. A rank SIGKILLs itself mid-run, then the whole step is
killed with kill -9 of every task right after a checkpoint; resumed, the final weights equal an
uninterrupted 4-rank run bit for bit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.wait import wait_for

from clusterops import checkpoint as ck
from clusterops.runner import free_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train.py")
ARGS = ["--steps", "60", "--ckpt-every", "10", "--samples", "256", "--batch-size", "8"]


def _srun_argv(*train_args) -> list:
    return ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--time=5", sys.executable, TRAIN, *ARGS, *train_args]


def _env(dc) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTEROPS_", "SLURM_"))}
    env.update(SLURM_CONF=str(dc.conf_path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")),
               PYTHONUNBUFFERED="1")
    return env


def _tasks_of(ck_dir: Path) -> list:
    """pids of the training tasks (on any dev-cluster node) writing to ck_dir."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if TRAIN.encode() in argv and str(ck_dir).encode() in argv and any(e.startswith(b"SLURMD_NODENAME=")
                                                                         for e in env):
            pids.append(int(d))
    return pids


def _sha(out: str) -> str:
    m = re.search(r"^done step=60 out=\S+ sha256=([0-9a-f]{64})", out, re.M)
    assert m, out
    return m.group(1)


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_srun_four_ranks_killed_and_resumed_bitwise(cluster, tmp_path):
    ref = subprocess.run(_srun_argv("--ckpt-dir", str(tmp_path / "ref")), env=_env(cluster),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_sha = _sha(ref.stdout)

    ck_dir = tmp_path / "ck"
    base = ["--ckpt-dir", str(ck_dir), "--step-sleep", "0.02"]
    # 1. rank 2 (on node3) SIGKILLs itself at step 25: srun ends the step
    p = subprocess.run(_srun_argv(*base, "--crash-at-step", "25", "--crash-rank", "2",
                                  "--crash-marker", str(tmp_path / "m")),
                       env=_env(cluster), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "crash step=25 rank=2" in p.stdout, p.stdout + p.stderr[-2000:]
    assert ck.latest_good(ck_dir, deep=True) == ck_dir / "step_00000020"
    # 2. kill -9 of every task (all four nodes) right after a checkpoint line (async saves)
    p = subprocess.Popen(_srun_argv(*base, "--async-save"), env=_env(cluster), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("ckpt step="):
            victims = wait_for(lambda: len(v := _tasks_of(ck_dir)) == 4 and v, 10, "the 4 training tasks",
                               interval_s=0.02, detail=lambda: str(_tasks_of(ck_dir)))
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            break
    p.communicate(timeout=120)
    assert p.returncode != 0, "".join(seen)
    # 3. resume to the end
    p = subprocess.run(_srun_argv(*base), env=_env(cluster), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^resume step=(\d+)", p.stdout, re.M)
    assert _sha(p.stdout) == ref_sha
    for _, path in ck.committed_steps(ck_dir):
        info = ck.verify(path, deep=True)
        assert info.ok and info.manifest["world_size"] == 4
