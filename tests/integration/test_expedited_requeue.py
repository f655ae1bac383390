"""Slurm 25.11's expedited requeue on a real cluster (issue 30, part 5).

Every tier: the cluster's own word decides. On Slurm before 25.11 (this machine's 22.05,
Debian 13's 24.11) `launch submit` of a spec asking `requeue: expedite` exits 2 with one
line naming the file and the key, and writes and submits nothing; a supervised job is
submitted with the ordinary `--requeue`; `devcluster up --expedited-requeue` is refused.

On 25.11 (scripts/test-slurm-25.11.sh), a separate dev cluster with
`SlurmctldParameters=enable_expedited_requeue` and `cred_expire=60` (the ordinary requeue's
delay: a requeued job is not eligible before it has passed): a supervised job is submitted
with `--requeue=expedite`; its lead signal makes the supervisor save and requeue, and the
next incarnation starts well inside those 60 s and ends bitwise equal to an uninterrupted
run; a job that gives up (its ranks crash at start) ends FAILED and is not left held in the
queue, which Slurm does to an expedited job whose batch script exits non-zero unless the
supervisor turns its Requeue off first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support import faultkit as fk

pytestmark = pytest.mark.integration

STEPS = 60
CRED_EXPIRE_S = 60


def _script(job: fk.TrainJob) -> str:
    """The batch script `launch submit` wrote for ``job`` (its log directory holds one)."""
    scripts = list((job.root / "logs").glob("*.sbatch"))
    assert len(scripts) == 1, scripts
    return scripts[0].read_text()


def test_an_expedite_the_cluster_cannot_give_is_refused_and_a_supervised_job_gets_the_ordinary_requeue(
        cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    v = slurm.version()
    # The shared dev cluster never enables it; on 25.11 the refusal names the parameter.
    want = ("the cluster's SlurmctldParameters lacks enable_expedited_requeue" if v >= (25, 11)
            else f"Slurm {v[0]}.{v[1]:02d} has no expedited requeue (25.11+)")
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: exp\nnodes: 1\nlauncher: srun\nscript: train.py\nlog_dir: logs\nrequeue: expedite\n")
    before = {j.job_id for j in slurm.jobs()}
    p = subprocess.run([sys.executable, "-m", "clusterops", "launch", "submit", str(spec)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [f"Error: {spec}: requeue: expedite: {want}; use requeue: true"], p.stderr
    assert not (tmp_path / "logs").exists() and {j.job_id for j in slurm.jobs()} == before
    job = fk.TrainJob(root=tmp_path / "sup", name="exp-sup", nodes=1, steps=5, ckpt_every=0, step_sleep=0)
    job.submit()
    script = _script(job)
    assert "#SBATCH --requeue\n" in script and "--requeue=expedite" not in script
    info = job.wait_end(slurm)
    assert info.state == "COMPLETED", job.slurm_says(slurm)


@pytest.fixture
def expedite_cluster(monkeypatch, tmp_path):
    """A 2-node dev cluster of its own with the expedited requeue enabled and the ordinary
    requeue's delay (cred_expire) at 60 s; on Slurm before 25.11 ``up`` refuses, and this
    yields None after checking that nothing was written."""
    from clusterops.devcluster import DevClusterConfig
    from clusterops.errors import InputError
    from conftest import own_dev_cluster, pick_port_base

    cfg = DevClusterConfig(nodes=2, port_base=pick_port_base(3), expedited_requeue=True, cred_expire_s=CRED_EXPIRE_S,
                           slurm_prefix=os.environ.get("CLUSTEROPS_SLURM_PREFIX") or None)
    with own_dev_cluster("exp") as dc:
        try:
            dc.up(cfg)
        except InputError as e:
            assert re.fullmatch(r"--expedited-requeue \(SlurmctldParameters=enable_expedited_requeue\): "
                                r"Slurm (\d+)\.(\d\d) is older than 25\.11", e.message), e.message
            assert not (dc.state / "slurm.conf").exists() and not dc.running()
            yield None
            return
        monkeypatch.setenv("SLURM_CONF", str(dc.conf_path))
        yield dc


@pytest.mark.timeout(480)
def test_the_expedited_requeue_restarts_at_once_and_a_give_up_leaves_nothing_held(expedite_cluster, tmp_path):
    if expedite_cluster is None:
        return          # Slurm before 25.11: the fixture checked the refusal
    from clusterops.slurm.factory import connect
    from clusterops.supervisor import timeline as tl

    slurm = connect()
    ref = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0", "--out", str(ref / "final.pt")],
                 workdir=ref)
    job = fk.TrainJob(root=tmp_path / "exp", name="exp", nodes=2, steps=STEPS, ckpt_every=10, step_sleep=0.1,
                      supervise={"stop_timeout_s": 20})
    job.submit()
    assert "#SBATCH --requeue=expedite\n" in _script(job)
    job.wait_step(15)
    slurm.signal(job.job_id, "USR1", batch=True)          # the lead signal: save, stop, requeue
    info, story = fk.assert_healed(job, slurm, ref / "final.pt", timeout_s=300)
    requeue = fk.events(job, "requeue")
    assert len(requeue) == 1 and info.restart_count == 1, story
    gap = [r for r in job.timeline() if r.get("incarnation") == 1][0]["t"] - requeue[0]["t"]
    print(f"\nexpedited requeue -> the next incarnation's first record: {gap:.1f} s "
          f"(the ordinary requeue waits cred_expire, {CRED_EXPIRE_S} s)")
    assert gap < CRED_EXPIRE_S / 2, story
    # A give-up (every rank exits 1 at start): Requeue=0 first, so the job ends FAILED
    # instead of coming back held.
    bad = fk.TrainJob(root=tmp_path / "bad", name="exp-bad", nodes=2, train_args=["--samples", "1"],
                      supervise={"no_progress_restarts": 1, "max_restarts": 5, "max_requeues": 3})
    bad.submit()
    end = bad.wait_end(slurm, timeout_s=240)
    story = tl.format_text(bad.timeline())
    assert end.state == "FAILED" and end.restart_count == 0, f"{end.state}\n{story}"
    assert fk.events(bad, "give_up") and fk.events(bad, "requeue_off"), story
