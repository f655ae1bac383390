"""The heartbeat channel's file fallback on the real dev cluster: the fault matrix's
SIGSTOP case with the channel forced to the per-node files (the network channel runs in
every case of tests/integration/test_fault_matrix.py, it is the default)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from clusterops import protocol
from clusterops.supervisor import channel as ch
from integration.test_fault_matrix import assert_healed, events, make_job, reference, slurm  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_file_fallback_stopped_rank_is_named_by_rank_and_node(cluster, slurm, reference, tmp_path):  # noqa: F811
    job = make_job(tmp_path, "hb-file", nodes=4, supervise={"hang_timeout_s": 10},
                   spec_extra={"env": {"OMP_NUM_THREADS": "1", ch.MODE_ENV: "file"}})
    job.submit()
    job.wait_step(25)
    hb = protocol.heartbeat_dir(protocol.attempt_dir(job.job_dir, 0))
    # One file per node on the job directory, none per rank.
    from clusterops.supervisor import timeline as tl

    got = sorted(p.name for p in hb.iterdir() if not p.name.startswith("."))
    assert got == [f"{protocol.NODE_HEARTBEAT_PREFIX}node{i}" for i in range(1, 5)], \
        f"{got}\n{sorted(p.name for p in job.job_dir.iterdir())}\n{tl.format_text(job.timeline())}"
    job.signal_rank(1, signal.SIGSTOP)
    info, story = assert_healed(job, slurm, reference, 4)
    lost = events(job, "heartbeat_lost")
    # Every rank gone quiet with the first stale one is named (which crosses the timeout
    # first is scheduling); the beats blame nobody else, and the stack capture, which took
    # them all, shows the stopped one held by the kernel.
    assert lost and 1 in lost[0]["ranks"] and "node2" in lost[0]["nodes"], story
    assert set(lost[0]["culprits"]) <= {1}, story
    stacks = events(job, "stacks")
    assert stacks, story
    dumps = "".join(p.read_text() for p in Path(stacks[0]["dir"]).glob("node*.txt"))
    assert re.search(r"=== rank 1 pid \d+ state T \(stopped\) ===", dumps), dumps
    exits = events(job, "step_exit")
    assert exits[0]["cause"] == "hang", story
    assert len(events(job, "launch")) == 2 and not events(job, "requeue"), story
