#!/bin/sh
# Slurm HealthCheckProgram wrapper for clusterops (see docs/health.md).
#
# slurmd runs this as root every HealthCheckInterval seconds (and before it registers,
# when the controller may not answer yet) and kills it after 60 s. It runs the `fast`
# profile (NVML, XID, host: about 1 s, no torch), drains this node with a
# "clusterops:health:<profile>: <probe>: <detail>" reason when a probe fails and lifts
# that drain when a later check re-checks the probe and it passes; drains it did not
# write (an administrator's, a supervisor's, a deeper check's) keep their reason. An
# `error` (a probe crashed or hung) never drains (exit 4), and past the site's
# drain.max_drained_fraction the node is left in service (exit 3); both are logged to
# syslog below. The Slurm calls are bounded, so an unreachable controller cannot make
# the check overrun.
#
# Settings (environment, or edit the defaults here):
#   CLUSTEROPS            path of the clusterops command
#   CLUSTEROPS_HEALTH_PROFILE   profile name or YAML file (default: fast)
#   CLUSTEROPS_HEALTH_SITE      site overrides file (read by clusterops itself)
#   CLUSTEROPS_PROM_FILE        Prometheus textfile to write (node_exporter textfile collector)
#   CLUSTEROPS_HEALTH_LOG       where the last report goes (default /var/log/clusterops-health.log)
#   CLUSTEROPS_HISTORY_DB       fleet history (postgresql://...) each check is recorded in, through a
#                               local spool; or history: {db: ...} in the site config (docs/sweep.md)
set -u
CLUSTEROPS=${CLUSTEROPS:-/opt/clusterops/bin/clusterops}
PROFILE=${CLUSTEROPS_HEALTH_PROFILE:-fast}
LOG=${CLUSTEROPS_HEALTH_LOG:-/var/log/clusterops-health.log}
PROM=${CLUSTEROPS_PROM_FILE:-}
if [ -z "$PROM" ] && [ -d /var/lib/node_exporter/textfile_collector ]; then
    PROM=/var/lib/node_exporter/textfile_collector/clusterops_health.prom
fi

set -- health check --profile "$PROFILE" --drain-on-fail --drain-timeout-s 15
if [ -n "$PROM" ]; then
    set -- "$@" --prometheus "$PROM"
fi

# Stay well inside slurmd's 60 s limit whatever happens.
timeout -k 5 45 "$CLUSTEROPS" "$@" >"$LOG.tmp" 2>&1
rc=$?
mv -f "$LOG.tmp" "$LOG" 2>/dev/null || true
if [ "$rc" -ne 0 ] && command -v logger >/dev/null 2>&1; then
    logger -t clusterops-health "health check exit $rc on ${SLURMD_NODENAME:-$(hostname -s)}: $(grep -m1 -E '^  (FAIL|ERROR)' "$LOG" 2>/dev/null | sed 's/^ *//')"
fi
exit "$rc"
