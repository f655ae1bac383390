#!/bin/sh
# Example Slurm Epilog: after a job, look for its leftover GPU processes and Xid events,
# and drain the node (clusterops reason) if the job left it unhealthy. Never fail the
# epilog for a Slurm hiccup: the exit code is the health check's.
CLUSTEROPS=${CLUSTEROPS:-/opt/clusterops/bin/clusterops}
timeout -k 5 30 "$CLUSTEROPS" health check --profile fast --drain-on-fail --drain-timeout-s 10 \
    >/var/log/clusterops-epilog.log 2>&1
exit 0
