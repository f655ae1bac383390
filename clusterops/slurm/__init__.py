"""Slurm access: every Slurm command clusterops runs is built here.

``api`` declares the interface (``SlurmAPI``, a ``Protocol``) and the rules both backends
keep (ours-only one-line drain reasons, the foreign-resume refusal, submit's checks, reads
retried with one ``Backoff``). ``Slurm`` (``client``) is the CLI backend: it runs the
queries and updates through one Runner; ``pyslurm_backend`` composes it and sends the
methods pyslurm serves as RPCs. Get a client with ``factory.connect`` (the backend and the
site timeouts and retries of ``settings``, read once). ``steps`` builds the argv of the ``srun`` job steps and the ``sbatch`` line that
other parts start through the Runner themselves (the supervisor watches its steps as
long-running processes). ``parse`` holds the pure parsers of Slurm's output (``--json``,
``--oneliner``, srun's error lines), ``states`` the one job-state table, ``tools`` where
the programs live (a ``--slurm-prefix``), ``gres`` the GPU counts, ``privilege`` the
caller's Slurm privilege level (user, operator, admin, SlurmUser). No module outside this
package spells a Slurm client program in an argv (tests/test_layout.py); the dev cluster
starts the Slurm daemons itself, by path through ``tools``.
"""

from clusterops.slurm.api import ForeignDrainError, SlurmAPI, SlurmError, SlurmUnavailable
from clusterops.slurm.client import Slurm
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import categorize

__all__ = ["ForeignDrainError", "Slurm", "SlurmAPI", "SlurmError", "SlurmUnavailable", "JobInfo", "NodeInfo", "categorize"]
