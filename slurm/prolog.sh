#!/bin/sh
# Example Slurm Prolog: refuse to start a job on a node that fails the fast health check.
# A non-zero exit makes Slurm drain the node and requeue the job (Slurm's own behaviour),
# so keep it fast: the `fast` profile, bounded by timeout. Note that Slurm then replaces the
# reason with its own "Prolog error", which clusterops will not resume by itself (it is not
# a clusterops reason): an administrator resumes such nodes, or exit 0 here and rely on
# --drain-on-fail alone (the job then still starts on the bad node once).
CLUSTEROPS=${CLUSTEROPS:-/opt/clusterops/bin/clusterops}
timeout -k 5 30 "$CLUSTEROPS" health check --profile fast --drain-on-fail --drain-timeout-s 10 \
    >/var/log/clusterops-prolog.log 2>&1
rc=$?
# 3: failing, but the fleet guard kept the node in service; 4: the check could not decide.
# Neither may become a Slurm "Prolog error" drain behind clusterops' back: let the job run.
case $rc in 3|4) exit 0 ;; esac
exit $rc
