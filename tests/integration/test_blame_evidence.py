"""Blame only with evidence (issue 28), on the real dev cluster.

Two nodes, one rank each: a plain script raises a Python exception on rank 0 (exit 1) and
srun ends rank 1. The traceback is the program's own word: the supervisor records
`program_error`, blames and excludes no node, does not requeue "to exclude" one, ends
the crash loop by the no-progress rule, and its give-up record and webhook carry the
traceback's last line. (Before the fix: `rank_exit` blaming node1 twice, `node_bad`, a
requeue to exclude a healthy node.)
"""

from __future__ import annotations

import textwrap

import pytest

from support import faultkit as fk
from support.webhook import Hook
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

RAISES = textwrap.dedent("""\
    import os, sys, time
    from clusterops import sdk          # a user's script with the SDK (its error report)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    print("step=0", flush=True)
    if rank == 0:
        state = {}
        optim = state["state"]          # KeyError: 'state'
    time.sleep(60)                      # rank 1: srun ends it once rank 0 has failed
    """)


@pytest.mark.timeout(150)
def test_traceback_on_rank0_of_2_is_program_error_and_blames_no_node(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    hook = Hook()
    try:
        script = tmp_path / "raises.py"
        script.write_text(RAISES)
        job = fk.TrainJob(root=tmp_path / "blame", name="blame", nodes=2, script=script,
                          supervise={"progress": {"regex": r"step=(\d+)"}, "no_progress_restarts": 1,
                                     "drain_bad_nodes": False},
                          spec_extra={"notify": [hook.url]})
        job.args = lambda: []     # the plain script takes no arguments
        job.submit()
        info = job.wait_end(slurm, timeout_s=110)
        story = tl.format_text(job.timeline())
        assert info.exit_code == sv.EXIT_NO_PROGRESS, f"{info.state} {info.exit_code}\n{story}\n{job.batch_log()[-3000:]}"
        exits = fk.events(job, "step_exit")
        assert len(exits) == 2, story                            # first try + K=1 restart
        # No blame, no exclusion, no requeue (true even when the traceback did not reach the log).
        assert all(e["blamed"] == [] and e["failures"][0]["rank"] == 0 for e in exits), story
        assert not fk.events(job, "node_bad"), story
        assert not fk.events(job, "requeue") and info.restart_count == 0, story
        # The traceback's last line: from the step log, or, when srun dropped the failed
        # task's last stderr as it ended the step (seen in CI), from the SDK's error report.
        for e in exits:
            assert e["cause"] == "program_error" and e.get("error") == "KeyError: 'state'", \
                f"{story}\n{job.failed_step_logs()}"
        give_up = fk.events(job, "give_up")
        assert give_up and give_up[0]["error"] == "KeyError: 'state'", story
        assert "KeyError: 'state'" in give_up[0]["reason"], story
        sent = [body for _, _, body in hook.got if body.get("event") == "job_given_up"]
        assert sent and sent[0]["details"]["error"] == "KeyError: 'state'", hook.got
    finally:
        hook.close()
