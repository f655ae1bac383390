"""The SDK<->supervisor contract (clusterops.protocol): its files, and that it is spelled once."""

from __future__ import annotations

import os
import re
from pathlib import Path

from clusterops import protocol

REPO = Path(__file__).resolve().parent.parent


def test_layout_and_rank_env(tmp_path):
    att = protocol.attempt_dir(tmp_path, 3)
    assert att == tmp_path / "attempt-3" and protocol.attempt_number(att) == 3
    assert protocol.attempt_number(tmp_path / "attempt-x") is None
    assert protocol.attempt_number(tmp_path / "preflight-0-1") is None
    assert protocol.heartbeat_path(tmp_path, 3, 5) == att / "heartbeat" / "rank5"
    env = protocol.rank_env(ckpt_dir=tmp_path / "ck", resume_from="", attempt=att, restart_count=2)
    assert sorted(env) == sorted(protocol.CONTRACT_ENV)
    assert env[protocol.ENV_HEARTBEAT_DIR] == str(protocol.heartbeat_dir(att))
    assert env[protocol.ENV_STOP_FILE] == str(protocol.stop_file(att))
    assert env[protocol.ENV_RESTART_COUNT] == "2" and env[protocol.ENV_RESUME_FROM] == ""


def test_heartbeats_written_and_read(tmp_path):
    hb = protocol.heartbeat_path(tmp_path, 1, 0).parent
    hb.mkdir(parents=True)
    protocol.write_heartbeat(hb, 0, 12)
    protocol.write_heartbeat(hb, 0, 13)
    (hb / "rank1").write_text("garbage\n")
    (hb / ".rank2.tmp").write_text("5\n")
    protocol.write_stopped(hb, step=13, path=None, reason="x")  # not a rank
    beats = protocol.read_heartbeats(hb)
    assert list(beats) == [0] and beats[0][0] == 13
    assert beats[0][1] == os.stat(protocol.heartbeat_path(tmp_path, 1, 0)).st_mtime
    assert protocol.read_heartbeats(tmp_path / "missing") == {}


def test_stop_file_and_stopped_marker_preferred_to_the_line(tmp_path):
    att = protocol.attempt_dir(tmp_path, 1)
    hb = protocol.heartbeat_dir(att)
    hb.mkdir(parents=True)
    stop = protocol.stop_file(att)
    assert not protocol.stop_requested(stop) and not protocol.stop_requested(None)
    protocol.request_stop(stop)
    assert protocol.stop_requested(stop)
    line = "0: " + protocol.stopped_line(40, "/ck/step_00000040", "SIGTERM")
    assert protocol.training_stopped(att, "0: step 3\n") is None
    assert protocol.training_stopped(att, "0: step 3\n" + line + "\n") == "line"
    assert protocol.training_stopped(None, line) == "line"
    protocol.write_stopped(hb, step=40, path="/ck/step_00000040", reason="SIGTERM")
    assert protocol.training_stopped(att, "") == "marker"
    assert protocol.read_stopped(hb) == {"step": 40, "path": "/ck/step_00000040", "reason": "SIGTERM"}
    (hb / protocol.STOPPED_MARKER).write_text("{torn")
    assert protocol.read_stopped(hb) == {} and protocol.training_stopped(att) == "marker"
    assert sorted(os.listdir(hb)) == [protocol.STOPPED_MARKER]  # no temporary left


def test_contract_names_are_spelled_only_in_protocol():
    """No module of the package (nor a template) spells a contract variable or the
    stopped line itself: they use clusterops.protocol."""
    spelled = list(protocol.CONTRACT_ENV) + ["stopped step="]
    assert all(re.fullmatch(r"CLUSTEROPS_[A-Z_]+", n) for n in protocol.CONTRACT_ENV)
    files = sorted((REPO / "clusterops").rglob("*.py")) + sorted((REPO / "templates").rglob("*.j2"))
    assert len(files) > 50
    found = []
    for f in files:
        if f == REPO / "clusterops" / "protocol.py":
            continue
        text = f.read_text()
        for name in spelled:
            if name in text:
                found.append(f"{f.relative_to(REPO)}: {name}")
    assert found == []
    # The check can fail: protocol.py itself spells every one of them.
    text = (REPO / "clusterops" / "protocol.py").read_text()
    assert all(name in text for name in spelled)


def test_supervisor_reads_the_marker_and_the_line_as_a_stop(tmp_path):
    from clusterops import supervisor as sv
    from clusterops.supervisor.run import RunConfig, SupervisorRun

    cfg = RunConfig(command=["true"], job_dir=tmp_path / "job", ckpt_dir=tmp_path / "ck",
                    policy=sv.Policy(nodes=1), nodes=["n1"])
    run = SupervisorRun(cfg, slurm=object(), echo=lambda line: None)  # no job id: no Slurm query
    run.attempt_dir = protocol.attempt_dir(cfg.job_dir, 1)
    hb = protocol.heartbeat_dir(run.attempt_dir)
    hb.mkdir(parents=True)
    assert run._external_stop("0: step 3\n") is None  # exit 0 without either: finished
    assert run._external_stop("0: " + protocol.stopped_line(3, None, "SIGTERM") + "\n") == "signal"
    protocol.write_stopped(hb, step=3, path=None, reason="SIGTERM")
    assert run._external_stop("0: step 3\n") == "signal"
