"""The fault kit finds (and kills) a rank of its own job only (issue 28).

The pytest-xdist workers each run a dev cluster on this one host: the same node names,
and job ids counted from the same first id, so two workers' jobs can both be job 2 with
a rank 1 running examples/train.py. A rank is looked up by its job id and rank *and* the
Slurm configuration its task names (SLURM_CONF, exported by slurmstepd to every task);
the processes here stand in for the two ranks with exactly those environments.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from clusterops.errors import ClusteropsError
from support import faultkit as fk
from support.wait import wait_for


@pytest.fixture
def two_clusters_ranks(tmp_path):
    """Rank 1 of job 4242 on cluster A and on cluster B, both running the training script."""
    procs = {}
    for name in ("a", "b"):
        conf = tmp_path / name / "slurm.conf"
        conf.parent.mkdir()
        conf.write_text("")
        env = {"SLURM_CONF": str(conf), "SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "PATH": "/usr/bin:/bin"}
        procs[name] = (conf, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                               str(fk.TRAIN_SCRIPT)], env=env))
    yield procs
    for _, p in procs.values():
        p.kill()
        p.wait()


def test_rank_lookup_sees_only_its_own_clusters_job(tmp_path, two_clusters_ranks):
    (conf_a, pa), (conf_b, pb) = two_clusters_ranks["a"], two_clusters_ranks["b"]
    job = fk.TrainJob(root=tmp_path / "job", name="scope")
    job.job_id = 4242
    job.slurm_conf = str(conf_a)              # what submit() records from the env it submits with
    found = wait_for(lambda: job.rank_pids(1) or None, 10, "rank 1's process to show in /proc")
    assert found == [pa.pid], f"found {found}; cluster A's rank is {pa.pid}, cluster B's {pb.pid}"
    job.slurm_conf = str(conf_b)
    assert job.rank_pids(1) == [pb.pid]
    assert job.rank_pids(0) == []


def test_submit_records_the_slurm_it_submits_to(tmp_path, monkeypatch):
    """The job's cluster comes from the environment ``submit`` hands ``launch submit``."""
    job = fk.TrainJob(root=tmp_path / "job", name="scope", python="/bin/false")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "mine.conf"))
    with pytest.raises(ClusteropsError):
        job.submit()                           # /bin/false: the submit itself fails
    assert job.slurm_conf == str(tmp_path / "mine.conf")
    with pytest.raises(ClusteropsError):
        job.submit(env={"SLURM_CONF": str(tmp_path / "other.conf")})
    assert job.slurm_conf == str(tmp_path / "other.conf")
    # An env that only adds a setting (the backend) still submits to this process's cluster.
    with pytest.raises(ClusteropsError):
        job.submit(env={"CLUSTEROPS_SLURM_BACKEND": "cli"})
    assert job.slurm_conf == str(tmp_path / "mine.conf")
