"""Exit codes as a contract, on the dev cluster (issue 30, part 2).

A plain script on 2 nodes and a spare whose rank 1 exits with a given code in the first
attempt (`CLUSTEROPS_RESTART_COUNT` 0) and finishes otherwise: 17 and 93 end the job with
exit 10 and no restart; 16 after `sdk.report_suspects` relaunches without the named node
(the spare takes its place, nothing drained); a code mapped to `requeue` requeues the job
(same id, the next incarnation finishes); one mapped to `relaunch` relaunches in place.
"""

from __future__ import annotations

import textwrap

import pytest

from support import faultkit as fk
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""\
    import os, sys, time
    from clusterops import sdk
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    first = os.environ.get("CLUSTEROPS_RESTART_COUNT", "0") == "0" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    print("step=1", flush=True)
    code = int(sys.argv[1])
    if rank == 1 and first:
        if code == 16:
            sdk.report_suspects(nodes=[os.environ["SLURMD_NODENAME"]], why="rerun state machine: result differs")
        time.sleep(0.5)
        sys.exit(code)
    time.sleep(2 if rank == 1 else 3)
    print("step=2", flush=True)
    """)


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("code,table,expect", [
    (17, None, "stop"), (93, None, "stop"), (16, None, "relaunch_without_suspects"),
    (42, {42: "requeue"}, "requeue"), (43, {43: "relaunch"}, "relaunch"),
])
def test_a_script_exit_code_does_what_the_table_says(cluster, slurm, tmp_path, code, table, expect):
    script = tmp_path / "exits.py"
    script.write_text(SCRIPT)
    sup = {"progress": {"regex": r"step=(\d+)"}, "spare_nodes": 1, "drain_bad_nodes": False}
    if table:
        sup["exit_codes"] = table
    job = fk.TrainJob(root=tmp_path / f"x{code}", name=f"x{code}", nodes=2, script=script, supervise=sup)
    job.args = lambda: [str(code)]
    job.submit()
    info = job.wait_end(slurm, timeout_s=200)
    story = tl.format_text(job.timeline()) + f"\n{job.batch_log()[-2000:]}"
    contract = fk.events(job, "exit_contract")
    assert contract and contract[0]["code"] == code and contract[0]["action"] == expect, story
    if expect == "stop":
        assert info.exit_code == sv.EXIT_SCRIPT_STOP and len(fk.events(job, "launch")) == 1, f"{info}\n{story}"
        assert not fk.events(job, "requeue"), story
        return
    assert info.state == "COMPLETED" and info.exit_code == 0 and fk.events(job, "done"), f"{info}\n{story}"
    if expect == "relaunch_without_suspects":
        assert contract[0]["suspects"] == ["node2"], story
        assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"], story
        assert "node2" not in fk.events(job, "launch")[-1]["nodes"] and not slurm.node("node2").drained, story
    elif expect == "requeue":
        assert len(fk.events(job, "requeue")) == 1 and info.restart_count == 1, story
    else:
        assert len(fk.events(job, "launch")) == 2 and not fk.events(job, "node_bad"), story
