"""Slurm access: every Slurm command clusterops runs is built here.

``Slurm`` (``client``) runs the queries and updates through one Runner, with bounded
retries for reads; get one with ``settings.connect`` (site timeouts and retries, read
once). ``steps`` builds the argv of the ``srun`` job steps and the ``sbatch`` line that
other parts start through the Runner themselves (the supervisor watches its steps as
long-running processes). ``parse`` holds the pure parsers of Slurm's output (``--json``,
``--oneliner``, srun's error lines), ``states`` the one job-state table, ``tools`` where
the programs live (a ``--slurm-prefix``), ``gres`` the GPU counts, ``privilege`` the
caller's Slurm privilege level (user, operator, admin, SlurmUser). No module outside this
package spells a Slurm client program in an argv (tests/test_layout.py); the dev cluster
starts the Slurm daemons itself, by path through ``tools``.
"""

from clusterops.slurm.client import ForeignDrainError, Slurm, SlurmError, SlurmUnavailable
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import categorize

__all__ = ["ForeignDrainError", "Slurm", "SlurmError", "SlurmUnavailable", "JobInfo", "NodeInfo", "categorize"]
