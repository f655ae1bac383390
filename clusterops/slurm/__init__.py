"""Slurm access: every Slurm command clusterops runs is built here.

The exception is the text of the scripts clusterops generates: the Slurm commands inside
a rendered sbatch script and the sweep's pair job (``srun``, ``scontrol show hostnames``)
are written by the Jinja templates (``templates/``) and run by the job itself, on the
``PATH`` that ``tools`` sets up.

The package, by module:

- ``api``: the interface (``SlurmAPI``, a ``Protocol``), the Slurm errors, and the rules
  both backends keep (ours-only one-line drain reasons, the foreign-resume refusal, submit's
  checks, reads retried with one ``Backoff``);
- ``client``: ``Slurm``, the CLI backend: queries and updates through one Runner, reads
  retried by ``api.retry_read``;
- ``pyslurm_backend``: the second backend: it composes the CLI client and sends the methods
  pyslurm serves as RPCs (``FORWARDED_TO_CLI`` names those it leaves to the CLI; the
  optional ``clusterops[pyslurm]`` extra);
- ``rest_backend``: the third backend: slurmrestd (Slurm's REST API), composing the CLI
  client for what the server's plugin version cannot do; one ``Adapter`` per version;
- ``restd``: slurmrestd's wire: the URL (http, https, a UNIX socket), the JWT each request
  carries (signed with the cluster's key, from ``scontrol token`` or ``SLURM_JWT``, renewed
  before it expires) and which plugin versions a server serves;
- ``factory``: ``connect()``, a client of the site's backend with its timeouts and retries;
- ``settings``: the site's timeouts, retries and backend, read once;
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

from clusterops.slurm.api import ForeignDrainError, SlurmAPI, SlurmError, SlurmUnavailable
from clusterops.slurm.client import Slurm
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import categorize

__all__ = ["ForeignDrainError", "Slurm", "SlurmAPI", "SlurmError", "SlurmUnavailable", "JobInfo", "NodeInfo", "categorize"]
