"""Node health checks: profile -> probes -> report, exit code, optional self-drain.

- ``profiles``: profiles (``fast``, ``preflight``, ``deep``, or a file) and the site
  config, loaded, merged and validated; the fleet guard's ``drain:`` settings;
- ``check``: the probe table (``REGISTRY``), ``run_check`` (the report, the ``--json``
  contract) and the exit codes (``EXIT_*``: 0 healthy, 1 unhealthy, 2 bad input,
  3 unhealthy but the fleet guard refused the self-drain, 4 the check could not decide);
- ``selfdrain``: the drain decision (pure) and the Slurm calls of ``--drain-on-fail``;
- ``output``: Prometheus text and the terminal table;
- ``flow``: one ``clusterops health check`` end to end (``check_node`` does it: inputs checked,
  the check, self-drain and its webhooks, the history record, the Prometheus file), and the
  one call of each other ``clusterops health`` command (``dist_rank``, ``ibbw_rank``...);
- ``probes/``: one module per kind of probe (NVML, XID, host, DCGM, matmul, dist).

This module re-exports the names the CLI, the supervisor and the tests use.
"""

from clusterops.health.check import (DEFAULT_TIMEOUT_S, EXIT_ERROR, EXIT_GUARD, EXIT_HEALTHY, EXIT_UNHEALTHY,
                                     EXIT_USAGE, REGISTRY, CheckRun, ProbeEntry, exit_code, first_problem,
                                     probe_specs, run_check)
from clusterops.health.output import format_table, health_metrics, prometheus_text
from clusterops.health.profiles import (SITE_ENV, Profile, builtin_dir, builtin_profiles, check_file,
                                        drain_settings, load_gpu_models, load_profile, load_site_config, merge,
                                        site_drain_settings)
from clusterops.health.selfdrain import drain_decision, drain_reason, self_drain

__all__ = [
    "CheckRun", "DEFAULT_TIMEOUT_S", "EXIT_ERROR", "EXIT_GUARD", "EXIT_HEALTHY", "EXIT_UNHEALTHY", "EXIT_USAGE",
    "ProbeEntry", "Profile", "REGISTRY", "SITE_ENV", "builtin_dir", "builtin_profiles", "check_file",
    "drain_decision", "drain_reason", "drain_settings", "exit_code", "first_problem", "format_table", "health_metrics",
    "load_gpu_models", "load_profile", "load_site_config", "merge", "probe_specs", "prometheus_text",
    "run_check", "self_drain", "site_drain_settings",
]
