"""Where a framework's rank comes from (clusterops.integrations.rank_layout), no framework loaded.

The supervisor's training step is an srun with one task per rank: SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, SLURM_STEP_ID, no torchrun
variables. torchrun's variables win when present; a batch shell (no step) is one process.
"""

from __future__ import annotations

import pytest

from clusterops.integrations import rank_layout

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID")


@pytest.fixture
def env(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)

    def set_(**kv):
        for k, v in kv.items():
            monkeypatch.setenv(k, str(v))
    return set_


def test_alone(env):
    assert rank_layout() == {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "num_nodes": 1}


def test_srun_step_two_nodes_one_rank_each(env):
    env(SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_LOCALID=0, SLURM_NTASKS_PER_NODE=1, SLURM_STEP_ID=0)
    assert rank_layout() == {"rank": 1, "world_size": 2, "local_rank": 0, "local_world_size": 1, "num_nodes": 2}


def test_srun_step_uneven_per_node_text(env):
    # Slurm writes "2(x3)" for three nodes of two tasks each.
    env(SLURM_PROCID=5, SLURM_NTASKS=6, SLURM_LOCALID=1, SLURM_NTASKS_PER_NODE="2(x3)", SLURM_STEP_ID=3)
    lay = rank_layout()
    assert (lay["rank"], lay["world_size"], lay["local_world_size"], lay["num_nodes"]) == (5, 6, 2, 3)


def test_batch_shell_without_a_step_is_one_process(env):
    env(SLURM_PROCID=0, SLURM_NTASKS=4)          # sbatch --ntasks=4, the batch script itself
    assert rank_layout()["world_size"] == 1


def test_torchrun_variables_win(env):
    env(RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2,
        SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=1, SLURM_STEP_ID=0)   # one agent per node
    assert rank_layout() == {"rank": 3, "world_size": 4, "local_rank": 1, "local_world_size": 2, "num_nodes": 2}


def test_hf_integration_gives_an_srun_task_torchruns_rank_variables(env):
    import os

    from clusterops.integrations.transformers import export_rank_env

    assert export_rank_env() is False and "WORLD_SIZE" not in os.environ        # alone: nothing
    env(SLURM_PROCID=3, SLURM_NTASKS=4, SLURM_LOCALID=1, SLURM_NTASKS_PER_NODE=2, SLURM_STEP_ID=0)
    assert export_rank_env() is True
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == \
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    # torchrun (or the user) already said: left alone
    env(RANK=0, WORLD_SIZE=8, LOCAL_RANK=0)
    assert export_rank_env() is False and os.environ["WORLD_SIZE"] == "8" and os.environ["RANK"] == "0"
