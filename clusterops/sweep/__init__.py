"""Fleet health sweeps: run the health check on many nodes, judge, drain, resume.

The package, from pure to side-effecting:

- ``results``: one node's result from its check (``result_from_check``) and the fleet
  comparison that flags stragglers (``mark_stragglers``) and nodes whose driver/VBIOS versions
  differ from their partition's (``mark_version_outliers``);
- ``policy``: the drain policy as a pure function (``plan_drains`` -> ``DrainPlan``),
  with the safety guard that refuses to drain too many nodes at once;
- ``scripts``: the per-node check command and the batch scripts, rendered from
  ``templates/sweep/``;
- ``slurm_fanout``: ``SlurmFanout``, one short exclusive check job pinned to each idle
  node; ``ssh``: the same over SSH (``ssh_fanout``), for nodes outside Slurm;
- ``pairs``: 2-node all-reduce jobs over pairs of healthy nodes;
- ``options``: ``SweepOptions``, the sweep's settings and their checks (exit 2);
- ``lock``: one sweep at a time per history (a file lock by SQLite, an advisory lock
  inside PostgreSQL, so two cron hosts sharing one history never both sweep);
- ``run``: ``run_sweep`` (select, check, judge, drain, record), ``apply_sweep_plan``
  (the code that changes node states after the checks; before them ``run_sweep`` resumes
  the nodes it rechecks) and the exit codes;
- ``session``: one ``clusterops sweep`` run around ``run_sweep`` (the lock, the history
  opened and pruned, webhooks, the report files), returning a ``SweepOutcome``.

Rules that never bend: a node whose check does not come back is ``unreachable``,
never healthy; a node that runs jobs is skipped and listed; a node drained or downed
by someone else is never touched; drain reasons carry their origin
(``clusterops:sweep:``, ``clusterops:straggler:``, ``clusterops:flapping:``) and who may
lift which drain is ``clusterops.drains.may_resume``.

This module re-exports the names the CLI, the benchmarks and the tests use.
"""

from clusterops.sweep.lock import FileLock, PgAdvisoryLock, SweepLocked, sweep_lock
from clusterops.sweep.pairs import run_pairs
from clusterops.sweep.policy import Action, DrainPlan, NodeSnapshot, allowed_drains, drain_reason, plan_drains
from clusterops.sweep.results import (FAILING, HEALTHY, METRICS, STATUSES, NodeResult, extract_metrics,
                                      fleet_medians, mark_stragglers, mark_version_outliers, parse_times,
                                      result_from_check)
from clusterops.sweep.options import MAX_TARGETS, MAX_TIMEOUT_S, SweepOptions, expand_nodes, unique
from clusterops.sweep.run import (EXIT_CANNOT_RUN, EXIT_GUARD, EXIT_LOCKED, EXIT_OK, EXIT_UNHEALTHY,
                                  SweepCannotRun, SweepReport, apply_sweep_plan, require_privilege, run_sweep)
from clusterops.sweep.scripts import check_argv, clusterops_argv
from clusterops.sweep.slurm_fanout import SlurmFanout, Target
from clusterops.sweep.ssh import ssh_fanout

__all__ = [
    "Action", "DrainPlan", "EXIT_CANNOT_RUN", "EXIT_GUARD", "EXIT_LOCKED", "EXIT_OK", "EXIT_UNHEALTHY",
    "FAILING", "FileLock", "HEALTHY", "PgAdvisoryLock", "SweepLocked", "sweep_lock", "MAX_TARGETS", "MAX_TIMEOUT_S", "METRICS", "NodeResult", "NodeSnapshot",
    "STATUSES", "SlurmFanout", "require_privilege", "SweepCannotRun", "SweepOptions", "SweepReport", "Target",
    "allowed_drains", "apply_sweep_plan", "check_argv", "clusterops_argv", "drain_reason",
    "expand_nodes", "extract_metrics", "fleet_medians", "mark_stragglers", "mark_version_outliers", "parse_times",
    "plan_drains", "result_from_check", "run_pairs", "run_sweep", "ssh_fanout", "unique",
]
