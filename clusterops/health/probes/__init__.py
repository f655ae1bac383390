"""Node health probes.

Each probe module exposes functions that take a probe configuration (a plain dict
from the resolved health profile) and a ProbeContext, and return a list of
ProbeResult. ``clusterops.health.probes.base.run_probes`` runs them, each under its own
deadline, so one hung probe becomes an ``error`` result instead of a hung check.
Modules: ``base`` (results, the deadline runner), ``nvml`` and ``nvml_standin``, ``amd`` and
``amd_standin`` (AMD GPUs through amdsmi), ``xid``,
``fabric`` (InfiniBand/RoCE from sysfs), ``ibbw`` (``ib_write_bw`` between a node pair), ``state`` (what a probe keeps between checks),
``dcgm``, ``host``, ``matmul``, ``dist``, ``copybw`` (copy bandwidths on the GPUs), ``sdc`` (a
fixed-seed workload's digest, for silent data corruption).

The names a profile may use, and the function each one runs, are the explicit table
``clusterops.health.check.REGISTRY``.

Heavy libraries (torch, pynvml) are imported inside the functions that use them:
the ``fast`` profile never imports torch.
"""
