"""Slurm access: the only part of clusterops that runs Slurm commands.

Parsers (``parse``) are pure functions over Slurm's machine-readable output;
``Slurm`` runs the commands through one Runner with bounded retries for reads.
"""

from clusterops.slurm.client import ForeignDrainError, Slurm, SlurmError, SlurmUnavailable
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.slurm.states import categorize

__all__ = ["ForeignDrainError", "Slurm", "SlurmError", "SlurmUnavailable", "JobInfo", "NodeInfo", "categorize"]
