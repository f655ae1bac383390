"""The srun/sbatch argv builders (pure): what the supervisor's steps and a submission run."""

from clusterops.slurm.steps import sbatch_argv, srun_argv, standby_step_argv


def test_training_step_argv():
    argv = srun_argv(["python", "train.py", "--lr", "0.1"], job_name="clusterops-train-3",
                     nodes=["node1", "node2"], ntasks_per_node=2, cpus_per_task=4, kill_on_bad_exit=True,
                     wait_s=60, label=True, extra=["--mpi=none"])
    assert argv == ["srun", "--job-name=clusterops-train-3", "--nodes=2", "--nodelist=node1,node2",
                    "--ntasks=4", "--ntasks-per-node=2", "--cpus-per-task=4", "--kill-on-bad-exit=1",
                    "--wait=60", "--label", "--mpi=none", "python", "train.py", "--lr", "0.1"]


def test_inprocess_training_step_outlives_a_lost_node():
    argv = srun_argv(["python", "t.py"], nodes=["n1", "n2"], ntasks_per_node=2, kill_on_bad_exit=False, no_kill=True)
    assert argv == ["srun", "--nodes=2", "--nodelist=n1,n2", "--ntasks=4", "--ntasks-per-node=2",
                    "--kill-on-bad-exit=0", "--no-kill", "python", "t.py"]
    assert "--no-kill" not in srun_argv(["python", "t.py"], nodes=["n1"], ntasks_per_node=1)


def test_check_and_capture_steps():
    live = srun_argv(["printenv", "SLURMD_NODENAME"], job_name="clusterops-liveness", nodes=["n1"],
                     ntasks_per_node=1, kill_on_bad_exit=False, output="/d/%t.out", error="/d/%t.err",
                     overlap=True)
    assert live == ["srun", "--job-name=clusterops-liveness", "--overlap", "--nodes=1", "--nodelist=n1",
                    "--ntasks=1", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--output=/d/%t.out",
                    "--error=/d/%t.err", "printenv", "SLURMD_NODENAME"]
    grab = srun_argv(["py"], jobid="12", overlap=True, nodes=["n3"], ntasks=1)
    assert grab == ["srun", "--jobid=12", "--overlap", "--nodes=1", "--nodelist=n3", "--ntasks=1", "py"]
    # Nothing asked, nothing added (no --wait=0, no --label).
    assert srun_argv(["true"]) == ["srun", "true"]
    assert srun_argv(["true"], wait_s=0) == ["srun", "--wait=0", "true"]


def test_standby_step_argv_one_task_overlapping_the_training_step():
    argv = standby_step_argv(["python", "train.py"], "node3", job_name="clusterops-train-1-standby-1", jobid="7",
                             cpus_per_task=2, extra=["--overcommit"])
    assert argv == ["srun", "--job-name=clusterops-train-1-standby-1", "--jobid=7", "--overlap", "--nodes=1",
                    "--nodelist=node3", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=2",
                    "--kill-on-bad-exit=0", "--label", "--overcommit", "python", "train.py"]


def test_sbatch_argv():
    assert sbatch_argv("/x/job.sh") == ["sbatch", "--parsable", "/x/job.sh"]
    assert sbatch_argv("/x/job.sh", ["--hold"], parsable=False) == ["sbatch", "--hold", "/x/job.sh"]
