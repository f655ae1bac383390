"""Slurm access: every Slurm command clusterops runs is built here.

The exception is the text of the scripts clusterops generates: the Slurm commands inside
a rendered sbatch script and the sweep's pair job (``srun``, ``scontrol show hostnames``)
are written by the Jinja templates (``templates/``) and run by the job itself, on the
``PATH`` that ``tools`` sets up.

The package, by module:

- ``client``: ``Slurm``, the CLI backend: queries and updates through one Runner, with
  bounded retries for reads;
- ``pyslurm_backend``: the second backend, the controller through pyslurm's RPCs (the
  optional ``clusterops[pyslurm]`` extra);
- ``settings``: the site's timeouts, retries and backend, read once; ``settings.connect``
  gives a client;
- ``steps``: the argv of the ``srun`` job steps and the ``sbatch`` line that other parts
  start through the Runner themselves (the supervisor watches its steps as long-running
  processes);
- ``parse``: the pure parsers of Slurm's output (``--json``, ``--oneliner``, srun's error
  lines);
- ``states``: the one job-state table;
- ``tools``: where the programs live (a ``--slurm-prefix``);
- ``gres``: a node's GPU count;
- ``privilege``: the caller's Slurm privilege level (user, operator, admin, SlurmUser).

No module outside this package spells a Slurm client program in an argv
(tests/test_layout.py); the dev cluster starts the Slurm daemons itself, by path through
``tools``.
"""

from clusterops.slurm.client import ForeignDrainError, Slurm, SlurmError, SlurmUnavailable
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import categorize

__all__ = ["ForeignDrainError", "Slurm", "SlurmError", "SlurmUnavailable", "JobInfo", "NodeInfo", "categorize"]
