"""The stability guard's edges: the heartbeat's loss keys (version 1, compatible both ways),
the SDK's interval figures and resume hint, the spec's `stability:` section, the no-SDK
placeholders and loss regex, and the timeline's records, chart, goodput and metrics."""

from __future__ import annotations

import json
import math

import pytest

from clusterops import heartbeat as hbc
from clusterops import protocol, sdk
from clusterops.errors import InputError
from clusterops.supervisor import timeline as tl
from clusterops.supervisor.config import stability_config
from clusterops.supervisor.run import PlainContract, ProgressReader


def test_datagram_carries_loss_and_grad_norm_non_finite_as_strings():
    d = hbc.Datagram("tok", "n1", 3, (hbc.RankBeat(0, 10, 5, 100, -1, 2.5, math.inf),
                                      hbc.RankBeat(1, 10, 5, 100, -1, math.nan, None)))
    raw = hbc.encode(d)
    body = json.loads(raw)
    assert body["v"] == 1 and body["loss"] == [2.5, "nan"] and body["gnorm"] == ["inf", None]
    back = hbc.decode(raw, "tok")
    assert back.ranks[0].loss == 2.5 and back.ranks[0].grad_norm == math.inf
    assert math.isnan(back.ranks[1].loss) and back.ranks[1].grad_norm is None


def test_datagram_without_signals_is_unchanged_and_bad_signals_are_refused():
    plain = hbc.Datagram("tok", "n1", 1, (hbc.RankBeat(0, 1, 0, 10),))
    assert b"loss" not in hbc.encode(plain) and hbc.decode(hbc.encode(plain), "tok").ranks[0].loss is None
    for bad in ('["x"]', '[true]', '[1, 2]', '"nan"', '["NaN"]'):
        raw = b'{"v":1,"tok":"tok","node":"n1","seq":1,"ranks":[[0,1,0,10]],"loss":' + bad.encode() + b"}"
        with pytest.raises(hbc.BadDatagram):
            hbc.decode(raw, "tok")


def test_node_sender_puts_the_interval_figures_on_the_wire(tmp_path):
    clock = [1000.0]
    s = hbc.NodeSender("file/tok123", str(tmp_path), 0, node="n1", root=str(tmp_path / "shm"),
                       clock=lambda: clock[0])
    s.beat(5, loss=1.25, grad_norm=math.nan)
    beats = s.collect(clock[0])
    assert beats[0].loss == 1.25 and math.isnan(beats[0].grad_norm)


def test_sdk_interval_figures_mean_loss_max_grad_norm_non_finite_wins():
    sdk._reset()
    for loss, g in ((1.0, 2.0), (3.0, 5.0), (2.0, 1.0)):
        sdk._take_signals(loss, g)
    assert sdk._pop_signals() == (2.0, 5.0)
    assert sdk._pop_signals() == (None, None)
    sdk._take_signals(1.0, math.nan)
    sdk._take_signals(math.inf, 9.0)
    loss, g = sdk._pop_signals()
    assert loss == math.inf and math.isnan(g)
    sdk._reset()


def test_sdk_resume_hint_only_for_its_checkpoint(monkeypatch):
    hint = protocol.ResumeHint(from_step=40, skip_batches=30, lr_factor=0.5, anomaly_step=61)
    monkeypatch.setenv(protocol.ENV_RESUME_HINT, hint.to_json())
    assert sdk.resume_hint() == hint and sdk.resume_hint(40) == hint and sdk.resume_hint(60) is None
    monkeypatch.setenv(protocol.ENV_RESUME_HINT, "{not json")
    assert sdk.resume_hint() is None


def test_spec_stability_section():
    assert stability_config({}) is None and stability_config({"stability": False}) is None
    assert stability_config({"stability": True}).on_nan == "rollback"
    cfg = stability_config({"stability": '{"on_spike": "stop", "factor": 8}'})   # the --stability flag: JSON
    assert cfg.on_spike == "stop" and cfg.factor == 8.0
    for bad, where in (({"on_nan": "heal"}, "on_nan"), ({"window": 1}, "window"), ({"pace": 3}, "pace"),
                       ({"lr_factor": -1}, "lr_factor"), ("[1]", "stability")):
        with pytest.raises(InputError, match=where):
            stability_config({"stability": bad})


def test_resume_args_placeholders():
    pc = PlainContract(progress_regex=r"step=(\d+)", resume_args=["--from", "{ckpt}", "--skip", "{skip_batches}",
                                                                 "--lr-x", "{lr_factor}"])
    assert pc.resume_argv("") == []
    assert pc.resume_argv("/c/7") == ["--from", "/c/7", "--skip", "0", "--lr-x", "1.0"]
    hint = protocol.ResumeHint(from_step=7, skip_batches=200, lr_factor=0.25)
    assert pc.resume_argv("/c/7", hint) == ["--from", "/c/7", "--skip", "200", "--lr-x", "0.25"]


def test_progress_reader_reads_the_loss(tmp_path):
    log = tmp_path / "step.log"
    hb = tmp_path / "hb"
    hb.mkdir()
    log.write_text("0: step=10 loss=2.5\n1: step=10 loss=2.7\n0: step=11 loss=nan\n1: noise loss=x\n")
    r = ProgressReader(r"step=(\d+)", log, hb, 2, loss_regex=r"loss=(\S+)")
    r.poll()
    assert r.signals[1] == (10, 2.7, None)
    assert r.signals[0][0] == 11 and math.isnan(r.signals[0][1])


def _story():
    t = 1000.0
    recs = [{"t": t, "event": "launch", "attempt": 0, "resume_step": None, "nodes": ["n1"]}]
    for i, step in enumerate(range(10, 70, 10)):
        recs.append({"t": t + 1 + i, "event": "progress", "step": step, "loss": 2.0 - step / 100})
    recs.append({"t": t + 7, "event": "progress", "step": 70, "loss": "nan"})
    recs.append({"t": t + 7.1, "event": "nan", "step": 70, "began": 61, "signal": "loss", "value": "nan",
                 "median": None, "limit": None, "ranks": [0], "decision": "rollback"})
    recs.append({"t": t + 7.2, "event": "rollback", "to_step": 40, "anomaly_step": 61, "skip_batches": 30,
                 "lr_factor": 0.5, "rollback": 1, "lost_steps": 30})
    recs.append({"t": t + 8, "event": "step_exit", "returncode": 137, "cause": "rolled_back"})
    recs.append({"t": t + 8.1, "event": "launch", "attempt": 1, "resume_step": 40, "nodes": ["n1"]})
    for i, step in enumerate(range(50, 110, 10)):
        recs.append({"t": t + 10 + i, "event": "progress", "step": step, "loss": 1.5 - step / 200})
    recs.append({"t": t + 16, "event": "done", "code": 0, "reason": "training finished"})
    return recs


def test_timeline_tells_the_rollback():
    recs = _story()
    text = tl.format_text(recs)
    assert "non-finite loss nan at step 70, began after step 60; decision: rollback" in text
    assert "ROLLBACK 1: to the checkpoint of step 40, skip 30 batches, lr x0.5 (30 steps lost)" in text
    s = tl.summary(recs)
    assert s["rollbacks"] == 1 and s["anomalies"] == [{"kind": "nan", "step": 70, "decision": "rollback"}]
    rep = tl.goodput_report(recs)
    assert rep["lost_s"]["recomputed"] > 0 and rep["lost_s"]["restart"] > 0   # rolled-back steps are lost
    svg = tl.render_svg(recs)
    assert svg.count('class="loss"') == 2 and 'class="loss-nonfinite"' in svg
    assert 'data-event="rollback"' in svg and 'data-event="nan"' in svg
    prom = tl.prometheus_text(recs, "j")
    assert 'clusterops_job_rollbacks{job="j"} 1' in prom and 'clusterops_job_anomalies{job="j",kind="nan"} 1' in prom


def test_prune_keeps_a_held_checkpoint_and_list_shows_why(tmp_path):
    from click.testing import CliRunner

    from clusterops import checkpoint as ck
    from clusterops.cli import cli

    _four_checkpoints(tmp_path)
    ck.hold(tmp_path, 20, "stability: newest checkpoint before the nan")
    plan = ck.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in plan.keep) == ["step_00000020", "step_00000040"]
    assert plan.held == {tmp_path / "step_00000020": "stability: newest checkpoint before the nan"}
    out = CliRunner().invoke(cli, ["ckpt", "list", str(tmp_path)]).output
    assert "step_00000020  step=20  ok" in out and "held: stability: newest checkpoint before the nan" in out
    (tmp_path / ck.HOLDS_FILE).write_text("{broken")
    assert ck.holds(tmp_path) == {}


def _four_checkpoints(root):
    from clusterops import checkpoint as ck

    for step in (10, 20, 30, 40):
        p = ck.PendingCheckpoint(root, step)
        (p.path / "w.bin").write_bytes(b"x" * step)
        p.record_file("w.bin")
        p.commit(world_size=1)


def test_release_lifts_named_holds_and_refuses_a_step_not_held(tmp_path):
    from clusterops import checkpoint as ck
    from support.props_harness import run_cli

    _four_checkpoints(tmp_path)
    ck.hold(tmp_path, 10, "stability: before the spike")
    ck.hold(tmp_path, 20, "stability: rollback 1 target")
    bad = run_cli(["ckpt", "release", str(tmp_path), "20", "30"])
    assert bad.code == 2 and "step_00000030 not held" in bad.stderr
    assert set(ck.holds(tmp_path)) == {"step_00000010", "step_00000020"}     # nothing released
    assert run_cli(["ckpt", "release", str(tmp_path)]).code == 2   # neither STEPS nor --all
    ok = run_cli(["ckpt", "release", str(tmp_path), "20"])
    assert ok.code == 0 and "released step_00000020 (held: stability: rollback 1 target)" in ok.stdout
    assert ck.holds(tmp_path) == {"step_00000010": "stability: before the spike"}
    plan = ck.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in plan.keep) == ["step_00000010", "step_00000040"]
    out = run_cli(["ckpt", "release", str(tmp_path), "--all", "--json"])
    assert out.code == 0 and '"step_00000010"' in out.stdout
    assert not (tmp_path / ck.HOLDS_FILE).exists()
    assert ck.prune(tmp_path, keep_last=1).keep == [tmp_path / "step_00000040"]


def test_prune_refuses_a_root_whose_holds_file_cannot_be_read(tmp_path):
    from clusterops import checkpoint as ck
    from support.props_harness import run_cli

    _four_checkpoints(tmp_path)
    (tmp_path / ck.HOLDS_FILE).write_text('["step_00000010"]')          # JSON, not a mapping
    res = run_cli(["ckpt", "prune", str(tmp_path), "--keep-last", "1"])
    assert res.code == 2 and ck.HOLDS_FILE in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [f"step_000000{n}" for n in (10, 20, 30, 40)]
    assert run_cli(["ckpt", "release", str(tmp_path), "--all"]).code == 2
    # The supervisor's next hold keeps what it could not read for a look and starts afresh.
    ck.hold(tmp_path, 30, "stability: before the nan")
    assert (tmp_path / (ck.HOLDS_FILE + ".bad")).read_text() == '["step_00000010"]'
    assert ck.holds(tmp_path) == {"step_00000030": "stability: before the nan"}


HOLD_MANY = """
import sys
from clusterops import checkpoint as ck
root, first = sys.argv[1], int(sys.argv[2])
for step in range(first, first + 40):
    ck.hold(root, step, f"by {first}")
"""


def test_holds_written_at_once_by_several_processes_are_all_kept(tmp_path):
    """Read-modify-write under the holds lock: no writer's hold is lost to another's."""
    import subprocess
    import sys

    from clusterops import checkpoint as ck

    procs = [subprocess.Popen([sys.executable, "-c", HOLD_MANY, str(tmp_path), str(first)])
             for first in (0, 1000, 2000, 3000)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    held = ck.holds(tmp_path)
    assert len(held) == 160 and held["step_00002039"] == "by 2000"


def test_a_holds_lock_held_elsewhere_bounds_the_wait_and_changes_nothing(tmp_path):
    """Whoever keeps the holds lock (a stuck process) cannot stall the supervisor's hold: the
    wait ends with an OSError, which the supervisor records, and the file is unchanged."""
    import fcntl
    import os
    import stat

    from clusterops.checkpoint import retention

    _four_checkpoints(tmp_path)
    retention.hold(tmp_path, 10, "before")
    lock = tmp_path / retention.HOLDS_LOCK
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600          # other users cannot open it to block it
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(OSError, match="held by another process"):
            with retention._holds_locked(tmp_path, wait_s=0.3):
                pass
    finally:
        os.close(fd)
    assert retention.holds(tmp_path) == {"step_00000010": "before"}


def test_the_callbacks_lr_factor_and_data_skip_hold_through_a_schedule():
    """What both framework callbacks apply on a rollback (clusterops.integrations): the LR
    factor survives the schedule's next step and a save/load of optimizer and schedule; the
    data index moves past each skip from its step on."""
    import torch

    from clusterops.integrations import data_index, scale_lr

    def make():
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    opt, sch = make()
    for _ in range(3):
        opt.step()
        sch.step()
    scale_lr([opt], [sch], 0.5)
    opt.step()
    sch.step()
    assert opt.param_groups[0]["lr"] == (1e-2 * 0.5) * (1.0 / 5)  # the schedule keeps the factor
    opt2, sch2 = make()
    opt2.load_state_dict(opt.state_dict())
    sch2.load_state_dict(sch.state_dict())
    opt2.step()
    sch2.step()
    assert opt2.param_groups[0]["lr"] == (1e-2 * 0.5) * (1.0 / 6)  # and so does a resume
    assert [data_index(s, [(10, 30), (50, 5)]) for s in (0, 9, 10, 49, 50)] == [0, 9, 40, 79, 85]
    assert data_index(7, []) == 7
