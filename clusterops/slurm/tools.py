"""Where Slurm's programs live: the one place that turns ``sinfo`` into the path that runs.

A site whose Slurm is not on ``PATH`` (``/opt/slurm``, or a 25.11 built into
``/opt/slurm-25.11``) names its prefix once: ``--slurm-prefix DIR`` on the commands that
take it, or ``CLUSTEROPS_SLURM_PREFIX=DIR`` in the environment. Client tools then run as
``DIR/bin/<tool>`` and daemons as ``DIR/sbin/<daemon>``. The environment handed to Slurm
commands puts ``DIR/bin`` first on ``PATH`` and carries the prefix variable, because
``sbatch`` exports the submitter's environment to the job: the batch script's own
``srun`` and the ``clusterops`` inside it must reach the same Slurm, not ``/usr/bin``'s.

Without a prefix, names are left bare and ``PATH`` decides, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from clusterops.errors import InputError

PREFIX_ENV = "CLUSTEROPS_SLURM_PREFIX"
# Programs installed under sbin/ by Slurm's `make install`; everything else is under bin/.
DAEMONS = frozenset({"slurmctld", "slurmd", "slurmdbd", "slurmrestd", "slurmstepd", "slurmscriptd", "sackd"})


def check_prefix(prefix: str | os.PathLike, source: str = "--slurm-prefix") -> Path:
    """The prefix as an absolute path, or a one-line InputError saying what is wrong with it."""
    text = str(prefix)
    if not text.strip():
        raise InputError(f"{source}: empty Slurm prefix")
    path = Path(text).expanduser().absolute()
    if not path.is_dir():
        raise InputError(f"{source}: {path}: no such directory")
    if not (path / "bin").is_dir():
        raise InputError(f"{source}: {path} holds no bin/ directory: not a Slurm installation prefix")
    return path


@dataclass(frozen=True)
class SlurmTools:
    """Resolves Slurm program names; ``prefix`` None means "whatever PATH finds"."""

    prefix: Optional[Path] = None
    source: str = "--slurm-prefix"     # named in error messages: the flag or the variable

    @classmethod
    def for_prefix(cls, prefix: Optional[str | os.PathLike], source: str = "--slurm-prefix") -> "SlurmTools":
        if prefix is None:
            return cls()
        return cls(check_prefix(prefix, source), source)

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> "SlurmTools":
        env = os.environ if environ is None else environ
        value = env.get(PREFIX_ENV)
        if value is None or value == "":
            return cls()
        return cls.for_prefix(value, PREFIX_ENV)

    def exe(self, name: str) -> str:
        """The program to run for ``name`` (``sbatch``, ``slurmd``, ...)."""
        if self.prefix is None:
            return name
        path = self.prefix / ("sbin" if name in DAEMONS else "bin") / name
        if not os.access(path, os.X_OK):
            raise InputError(f"{self.source}: {path}: no such program in the Slurm prefix {self.prefix}")
        return str(path)

    def argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` with its program resolved."""
        if not argv:
            raise InputError("empty command")
        return [self.exe(argv[0]), *argv[1:]]

    def env(self, base_path: Optional[str] = None) -> Dict[str, str]:
        """Environment entries for processes that run Slurm programs (and jobs they submit)."""
        if self.prefix is None:
            return {}
        path = base_path if base_path is not None else os.environ.get("PATH", os.defpath)
        front = [str(self.prefix / "bin"), str(self.prefix / "sbin")]
        rest = [p for p in path.split(os.pathsep) if p and p not in front]
        return {"PATH": os.pathsep.join(front + rest), PREFIX_ENV: str(self.prefix)}

    def missing(self, names: Sequence[str]) -> List[str]:
        """Which of ``names`` cannot be run (not in the prefix, or not on PATH)."""
        import shutil

        out = []
        for name in names:
            if self.prefix is None:
                if not shutil.which(name):
                    out.append(name)
            else:
                path = self.prefix / ("sbin" if name in DAEMONS else "bin") / name
                if not os.access(path, os.X_OK):
                    out.append(name)
        return out
