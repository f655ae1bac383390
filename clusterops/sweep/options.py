"""A sweep's settings: ``SweepOptions`` and the hostlist rules, checked before Slurm is asked
anything (a bad one is ``InputError``, exit 2).

Kept apart from ``run`` so that the pieces a sweep drives (``pairs``, ``ssh``) can name
the options without importing the module that drives them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from clusterops.errors import InputError

MAX_TARGETS = 100_000     # a hostlist typo like node[1-99999999] must not eat the memory
MAX_TIMEOUT_S = 7 * 86400.0  # also keeps NaN and infinity out (they fail every comparison)


@dataclass
class SweepOptions:
    partition: Optional[str] = None
    nodes: Optional[str] = None            # hostlist
    profile: str = "fast"
    via: str = "slurm"                     # slurm | ssh
    concurrency: int = 32                  # ssh sessions / parallel sbatch calls
    max_running: int = 0                   # Slurm: check jobs in flight at once (0: all)
    drain: bool = False
    max_drain_fraction: float = 0.1
    dry_run: bool = False
    timeout_s: float = 300.0               # per check (Slurm: from submission)
    connect_timeout_s: float = 10.0
    pairs: bool = False
    flap_k: int = 3
    flap_n: int = 5
    straggler_tolerance: float = 0.10
    drain_stragglers: bool = False
    recheck_drained: bool = True           # resume-check nodes clusterops drained (Slurm, not dry-run)
    check_cmd: Optional[List[str]] = None
    work_dir: Optional[str] = None
    keep_work_dir: bool = False
    accept_new_hosts: bool = False
    ssh_config: Optional[str] = None
    known_hosts: Optional[str] = None
    ssh_key: Optional[str] = None
    ssh_user: Optional[str] = None
    ssh_port: Optional[int] = None

    def validate(self) -> None:
        if self.partition and self.nodes:
            raise InputError("--partition and --nodes: give one or the other")
        if self.via not in ("slurm", "ssh"):
            raise InputError(f"--via: must be slurm or ssh, got {self.via!r}")
        if self.concurrency < 1:
            raise InputError(f"--concurrency: must be at least 1, got {self.concurrency}")
        if self.max_running < 0:
            raise InputError(f"--max-running: must be 0 (no cap) or more, got {self.max_running}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise InputError(f"--timeout: must be positive and at most {MAX_TIMEOUT_S:g} s, got {self.timeout_s}")
        if not 0 <= self.max_drain_fraction <= 1:
            raise InputError(f"--max-drain-fraction: must be between 0 and 1, got {self.max_drain_fraction}")
        if not 1 <= self.flap_k <= self.flap_n:
            raise InputError(f"--flap-k/--flap-n: need 1 <= k <= n, got k={self.flap_k} n={self.flap_n}")
        if not 0 <= self.straggler_tolerance < 1:
            raise InputError(f"--straggler-tolerance: must be in [0, 1), got {self.straggler_tolerance}")
        if not 0 < self.connect_timeout_s <= MAX_TIMEOUT_S:
            raise InputError(f"--connect-timeout: must be positive and at most {MAX_TIMEOUT_S:g} s, "
                             f"got {self.connect_timeout_s}")
        if self.flap_n > 1000:
            raise InputError(f"--flap-n: at most 1000 sweeps, got {self.flap_n}")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise InputError(f"--ssh-port: must be 1..65535, got {self.ssh_port}")
        if self.drain_stragglers and not self.drain:
            raise InputError("--drain-stragglers: needs --drain")
        if self.check_cmd is not None and not self.check_cmd:
            raise InputError("--check-cmd: empty command")
        if self.pairs and self.via != "slurm":
            raise InputError("--pairs: needs --via slurm (pairs run as 2-node Slurm jobs)")
        if self.work_dir is not None and Path(self.work_dir).exists() and not Path(self.work_dir).is_dir():
            raise InputError(f"--work-dir: {self.work_dir} exists and is not a directory")
        if self.via == "ssh":
            for flag, value in (("--ssh-key", self.ssh_key), ("--ssh-config", self.ssh_config)):
                if value is not None and not Path(os.path.expanduser(value)).is_file():
                    raise InputError(f"{flag}: {value}: no such file")
            if self.known_hosts is not None and Path(os.path.expanduser(self.known_hosts)).is_dir():
                raise InputError(f"--known-hosts: {self.known_hosts} is a directory")
        if self.nodes is not None:
            expand_nodes(self.nodes)

    def changes_nodes(self) -> bool:
        """True when this sweep may drain or resume nodes (a Slurm admin's right: see
        ``clusterops.slurm.privilege``): with --drain, or via Slurm, whose rechecks resume
        clusterops-drained nodes for their check. A dry run changes nothing."""
        if self.dry_run:
            return False
        return self.drain or (self.via == "slurm" and self.recheck_drained)

    def validate_profile(self) -> None:
        """The profile must load here (name or file, with the site config) before any node
        is asked to run it; a wrapped check (--check-cmd) is the site's own business."""
        if self.check_cmd:
            return
        from clusterops.health import load_profile

        load_profile(self.profile)


def expand_nodes(text: str) -> List[str]:
    import hostlist

    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as e:
        raise InputError(f"--nodes: bad hostlist {text!r}: {e}") from None
    except (ValueError, MemoryError, OverflowError) as e:
        raise InputError(f"--nodes: bad hostlist {text!r}: {e}") from None
    if not names:
        raise InputError("--nodes: empty hostlist")
    if len(names) > MAX_TARGETS:
        raise InputError(f"--nodes: {len(names)} nodes is more than one sweep takes ({MAX_TARGETS})")
    return unique(names)


def unique(names: Iterable[str]) -> List[str]:
    """Names in first-seen order, each once (a node listed twice is checked once)."""
    return list(dict.fromkeys(names))


