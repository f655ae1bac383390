"""``on_nan``/``on_spike: replay``: the pure verdict, the machine's flow (events in, actions
out, a fake clock), the protocol's reports, the SDK's replay mode and the rotated rank layout
of the generated per-task command."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from clusterops import protocol
from clusterops import supervisor as sv
from clusterops.supervisor import (CheckpointCommitted, Heartbeats, KillStep, Launch, Policy, Record, ResumeChosen,
                                   SetAside, StepExited, StepLaunched, Supervisor)
from clusterops.supervisor import stability as stb
from clusterops.supervisor.run import rank_env_command, torchrun_command
from clusterops.supervisor.stability import Finding, Kind, ReplayVerdict, StabilityConfig, judge_replay

NODES = ["node1", "node2", "node3"]


def only(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def records(actions, kind):
    return [a.data for a in actions if isinstance(a, Record) and a.kind == kind]


# ------------------------------------------------------------------------- the verdict
NAN = Finding(Kind.NAN, step=24, began=21, signal="loss", value=math.inf, ranks=(0, 1, 2))


def report(reached, first=None, losses=None):
    return {"reached": reached, "first_nonfinite": first, "losses": losses or {}}


def test_a_nan_at_the_same_step_on_other_nodes_is_the_data():
    j = judge_replay(NAN, {0: (23, "node1"), 1: (23, "node2"), 2: (23, "node3")},
                     {r: report(26, 23) for r in range(3)}, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.DATA and j.reproduced and j.replay_step == 23 and j.node is None


def test_a_clean_replay_names_the_node_whose_rank_went_first():
    j = judge_replay(NAN, {1: (23, "node2"), 0: (24, "node1"), 2: (24, "node3")},
                     {r: report(26) for r in range(3)}, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.HARDWARE and j.reproduced is False
    assert j.node == "node2" and j.ranks == (1,)


def test_every_node_at_once_or_no_evidence_names_nobody():
    clean = {r: report(26) for r in range(3)}
    j = judge_replay(NAN, {r: (23, f"node{r + 1}") for r in range(3)}, clean, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.AMBIGUOUS and j.reproduced is False and j.node is None
    j = judge_replay(NAN, {}, clean, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.AMBIGUOUS and j.node is None
    # One node's ranks at once, in a one-node run: that node (it was replayed elsewhere).
    j = judge_replay(NAN, {0: (23, "node1"), 1: (23, "node1")}, {0: report(26), 1: report(26)}, ranks=2, until=26,
                     single_node=True)
    assert j.verdict == ReplayVerdict.HARDWARE and j.node == "node1"


def test_a_replay_that_cannot_tell_is_ambiguous_and_not_a_clean_bill():
    nf = {1: (23, "node2")}
    short = {0: report(26), 1: report(22)}                   # a rank ended early; one never reported
    j = judge_replay(NAN, nf, short, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.AMBIGUOUS and j.reproduced is None
    other = {r: report(26, 25) for r in range(3)}             # non-finite, but at another step
    j = judge_replay(NAN, nf, other, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.AMBIGUOUS and j.reproduced is None and j.replay_step == 25


def test_a_spike_is_reproduced_when_the_replayed_loss_is_above_the_band_again():
    f = Finding(Kind.SPIKE, step=30, began=29, signal="loss", value=9.0, band=(1.0, 2.0))
    high = {r: report(32, losses={"29": 1.1, "30": 8.5}) for r in range(2)}
    j = judge_replay(f, {}, high, ranks=2, until=32)
    assert j.verdict == ReplayVerdict.DATA and j.replay_step == 30
    low = {r: report(32, losses={"29": 1.1, "30": 1.2}) for r in range(2)}
    j = judge_replay(f, {}, low, ranks=2, until=32)
    assert j.verdict == ReplayVerdict.AMBIGUOUS and j.reproduced is False     # a spike names no node
    # The guard's step lagged the spike (beats a second apart): the replay's margin finds it.
    late = {r: report(32, losses={"29": 1.1, "30": 1.2, "32": 8.0}) for r in range(2)}
    j = judge_replay(f, {}, late, ranks=2, until=32)
    assert j.verdict == ReplayVerdict.DATA and j.replay_step == 32
    # With no rank's own word on where a NaN began, one anywhere up to the replay's end is the data.
    j = judge_replay(NAN, {}, {r: report(26, 26) for r in range(3)}, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.DATA and j.replay_step == 26


def test_a_replay_that_stops_before_the_first_nonfinite_step_blames_nobody():
    """The guard saw the NaN at step 24 (a lagging beat), the ranks first went non-finite at
    27 on node2 alone: a replay that stopped at 26 never ran the step, so it is no clean bill
    and names no node; the replay's end covers the ranks' step."""
    nf = {1: (27, "node2"), 0: (28, "node1"), 2: (28, "node3")}
    j = judge_replay(NAN, nf, {r: report(26) for r in range(3)}, ranks=3, until=26)
    assert j.verdict == ReplayVerdict.AMBIGUOUS and j.reproduced is None and j.node is None
    assert "did not reach step 27" in j.why
    assert stb.replay_until(NAN, nf, 2) == 29
    assert stb.replay_until(NAN, {0: (23, "node1")}, 2) == 26 and stb.replay_until(NAN, {}, 2) == 26
    j = judge_replay(NAN, nf, {r: report(29) for r in range(3)}, ranks=3, until=29)
    assert j.verdict == ReplayVerdict.HARDWARE and j.node == "node2"


# ------------------------------------------------------------------------- the machine
def running(**cfg):
    cfg = dict(dict(on_nan="replay", warmup_steps=0, min_samples=3, patience=1, rollback_steps=10, skip_batches=30,
                    lr_factor=0.5, max_rollbacks=2, replay_margin_steps=2), **cfg)
    s = Supervisor(Policy(nodes=3, preflight=None, liveness_check=False, spare_nodes=1, drain_bad_nodes=True),
                   NODES + ["node4"],
                   stability=StabilityConfig(**cfg))
    s.start(now=0.0)
    s.handle(ResumeChosen(0.5, None, ""))
    s.handle(StepLaunched(1.0))
    return s


def beat(s, now, step, loss, nonfinite=None):
    return s.handle(Heartbeats(now, {r: (step, now) for r in range(3)},
                               signals={r: (step, loss, None) for r in range(3)}, nonfinite=nonfinite or {}))


def steady_to_step_22(s):
    """Steady beats for steps 1-22 and checkpoints 10 and 20: the run before the anomaly."""
    for i, step in enumerate(range(1, 23)):
        beat(s, 2.0 + i, step, 1.0 + 0.001 * (step % 3))
    for step in (10, 20):
        s.handle(CheckpointCommitted(25.0, step, f"/ck/{step}"))
    return s


def to_replay(s):
    """Checkpoints 10 and 20 (20 before the anomaly), a NaN seen at step 24 whose rank 1 (node2)
    went first at step 23, the kill, the disk's word: the replay launch."""
    steady_to_step_22(s)
    acts = beat(s, 30.0, 24, math.inf, {1: (23, "node2"), 0: (24, "node1"), 2: (24, "node3")})
    assert records(acts, "nan")[0]["decision"] == "replay"
    assert only(acts, KillStep) == [KillStep("replay")] and s.state == sv.KILLING
    acts = s.handle(StepExited(31.0, returncode=137, ckpt_step=20))
    assert only(acts, sv.PickRollback) == [sv.PickRollback(22, 20)]
    acts = s.handle(sv.RollbackPicked(31.0, 20, "/ck/20"))
    assert only(acts, SetAside) == [SetAside(20, "replay of the nan from step 23")]
    started = records(acts, "replay_started")[0]
    assert (started["from_step"], started["until"], started["first_ranks"], started["first_nodes"]) == (
        20, 26, [1], ["node2"])
    launch = only(acts, Launch)[0]
    assert launch.hint is None and launch.rotate == 1 and launch.nodes == ("node1", "node2", "node3")
    assert protocol.ReplayOrder.from_json(launch.replay) == protocol.ReplayOrder(20, 26)
    # The same ranks on other hardware: rank r where rank r+1 ran.
    assert [s.rank_node(r) for r in range(3)] == ["node2", "node3", "node1"]
    assert records(acts, "launch")[0]["replay"]["ranks"] == {"0": "node2", "1": "node3", "2": "node1"}
    assert s.state == sv.RUNNING and s.replay is not None
    s.handle(ResumeChosen(32.0, 20, "/ck/20"))
    s.handle(StepLaunched(32.5))
    # The replay's own non-finite beats are not a new finding: the replay is judged at its end.
    acts = beat(s, 33.0, 23, math.nan, {0: (23, "node2")})
    assert not only(acts, KillStep) and not records(acts, "nan")
    return s


def test_the_replay_runs_past_the_ranks_first_nonfinite_step_when_the_guard_saw_it_earlier():
    s = steady_to_step_22(running())
    acts = beat(s, 30.0, 24, math.nan, {1: (27, "node2"), 0: (28, "node1"), 2: (28, "node3")})
    assert records(acts, "nan")[0]["decision"] == "replay"
    s.handle(StepExited(31.0, returncode=137, ckpt_step=20))
    acts = s.handle(sv.RollbackPicked(31.0, 20, "/ck/20"))
    started = records(acts, "replay_started")[0]
    assert (started["until"], started["first_step"]) == (29, 27)
    assert protocol.ReplayOrder.from_json(only(acts, Launch)[0].replay) == protocol.ReplayOrder(20, 29)


def test_replay_not_reproduced_blames_the_node_and_goes_on_without_a_skip():
    s = to_replay(running())
    acts = s.handle(StepExited(40.0, returncode=0, ckpt_step=20, replay={r: report(26) for r in range(3)}))
    dec = records(acts, "replay_decided")[0]
    assert dec["verdict"] == "hardware" and dec["node"] == "node2" and dec["ranks"] == [1] and not dec["reproduced"]
    assert [r["node"] for r in records(acts, "node_bad")] == ["node2"]
    drains = only(acts, sv.DrainNodes)
    assert [d.nodes for d in drains] == [("node2",)] and drains[0].reason.startswith("clusterops:sdc:")
    rb = records(acts, "rollback")[0]
    assert (rb["to_step"], rb["skip_batches"], rb["lr_factor"], rb["replay"]) == (20, 0, 1.0, "hardware")
    launch = only(acts, Launch)[0]
    assert launch.replay == "" and launch.rotate == 0 and "node2" not in launch.nodes
    assert launch.hint.skip_batches == 0 and launch.hint.from_step == 20
    assert [s.rank_node(r) for r in range(3)] == list(launch.nodes)
    assert not only(acts, SetAside) and s.stability.rollbacks == [23]


def test_replay_reproduced_is_the_data_rollback_with_the_skip():
    s = to_replay(running())
    acts = s.handle(StepExited(40.0, returncode=0, ckpt_step=20, replay={r: report(26, 23) for r in range(3)}))
    dec = records(acts, "replay_decided")[0]
    assert dec["verdict"] == "data" and dec["node"] is None and dec["replay_step"] == 23
    assert not records(acts, "node_bad") and not only(acts, sv.DrainNodes)
    assert only(acts, sv.PickRollback) == [sv.PickRollback(13, 10)] and s.state == sv.KILLING
    acts = s.handle(sv.RollbackPicked(40.5, 10, "/ck/10"))
    rb = records(acts, "rollback")[0]
    # skip 30 from step 10 would end at 39; it reaches 20 (skip 30 - rollback 10) past step
    # 24, the NaN seen: 34 batches (stability.skip_for)
    assert (rb["to_step"], rb["skip_batches"], rb["lr_factor"]) == (10, 34, 0.5)
    assert only(acts, SetAside) == [SetAside(10, "rollback 1 (nan from step 23)")]
    launch = only(acts, Launch)[0]
    assert launch.hint.skip_batches == 34 and launch.rotate == 0 and launch.replay == ""
    assert launch.nodes == ("node1", "node2", "node3")


def test_a_replay_that_crashed_blames_nobody_and_rolls_back_with_the_skip():
    s = to_replay(running())
    acts = s.handle(StepExited(40.0, returncode=1, ckpt_step=20,
                               failures=(sv.RankFailure("node3", 1, "Exited with exit code 1"),)))
    dec = records(acts, "replay_decided")[0]
    assert dec["verdict"] == "ambiguous" and dec["reproduced"] is None and dec["node"] is None
    assert not records(acts, "node_bad") and only(acts, sv.PickRollback) == [sv.PickRollback(13, 10)]


def test_replay_with_no_checkpoint_before_the_anomaly_gives_up_as_a_rollback_does():
    s = running()
    for i, step in enumerate(range(1, 23)):
        beat(s, 2.0 + i, step, 1.0)
    acts = beat(s, 30.0, 24, math.nan)
    assert [d.data["decision"] for d in only(acts, Record) if d.kind == "nan"] == ["give_up"]
    acts = s.handle(StepExited(31.0, returncode=137))
    assert only(acts, sv.Exit)[0].code == sv.EXIT_ROLLBACK_BUDGET


def test_replay_is_a_valid_action_and_a_bad_one_is_a_one_line_error():
    from clusterops.errors import InputError
    from clusterops.supervisor.config import stability_config

    assert stability_config({"stability": {"on_nan": "replay", "on_spike": "replay"}}).on_spike == "replay"
    with pytest.raises(InputError) as e:
        stability_config({"stability": {"on_nan": "replay-it"}})
    assert "supervise.stability.on_nan" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError) as e:
        stability_config({"stability": {"replay_margin_steps": -1}})
    assert "supervise.stability.replay_margin_steps" in str(e.value)


# ------------------------------------------------------------------------- the contract
def test_reports_round_trip_and_bad_ones_are_left_out(tmp_path):
    protocol.write_nonfinite(tmp_path, 1, 23, "node2", math.inf)
    protocol.write_nonfinite(tmp_path, 0, 24, "node1", math.nan)
    (tmp_path / protocol.NONFINITE_DIR / "rank7.json").write_text("{not json")
    assert protocol.read_nonfinite(tmp_path) == {1: (23, "node2"), 0: (24, "node1")}
    protocol.write_replay_report(tmp_path, 0, reached=26, first_nonfinite=None, node="node2",
                                 losses={21: 1.5, 22: math.nan})
    (tmp_path / protocol.REPLAY_DIR / "rank1.json").write_text(json.dumps({"reached": "26"}))
    got = protocol.read_replay_reports(tmp_path)
    assert list(got) == [0] and got[0]["losses"] == {"21": 1.5, "22": "nan"} and got[0]["reached"] == 26
    assert stat_mode(tmp_path / protocol.REPLAY_DIR / "rank0.json") == 0o600
    assert protocol.ReplayOrder.from_json("") is None
    with pytest.raises(ValueError, match=protocol.ENV_REPLAY):
        protocol.ReplayOrder.from_json('{"from_step": 3}')


def stat_mode(p):
    return os.stat(p).st_mode & 0o777


def test_the_sdk_in_replay_mode_saves_nothing_reports_and_ends(tmp_path, monkeypatch):
    from clusterops import sdk

    hb = tmp_path / "hb"
    hb.mkdir()
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(hb))
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path / "ck"))
    monkeypatch.setenv(protocol.ENV_REPLAY, protocol.ReplayOrder(20, 23).to_json())
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv(protocol.ENV_HEARTBEAT_ADDR, raising=False)
    sdk._reset()
    try:
        assert sdk.save({"w": 1}, 21) is None and not (tmp_path / "ck").exists()
        sdk.heartbeat(21, loss=1.25)
        sdk.heartbeat(22, loss=float("inf"))
        with pytest.raises(SystemExit) as e:
            sdk.heartbeat(23, loss=float("nan"))
        assert e.value.code == 0
    finally:
        sdk._reset()
    rep = protocol.read_replay_reports(hb)[2]
    assert rep["reached"] == 23 and rep["first_nonfinite"] == 22 and rep["node"] == "node3"
    assert rep["losses"] == {"21": 1.25, "22": "inf", "23": "nan"}
    assert protocol.read_nonfinite(hb) == {2: (22, "node3")}      # once, the first


def test_the_first_nonfinite_is_reported_once_outside_a_replay(tmp_path, monkeypatch):
    from clusterops import sdk

    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.delenv(protocol.ENV_REPLAY, raising=False)
    monkeypatch.delenv(protocol.ENV_HEARTBEAT_ADDR, raising=False)
    sdk._reset()
    try:
        sdk.heartbeat(5, loss=1.0)
        assert protocol.read_nonfinite(tmp_path) == {}
        sdk.heartbeat(6, loss=2.0, grad_norm=float("nan"))
        sdk.heartbeat(7, loss=float("inf"))
    finally:
        sdk._reset()
    assert protocol.read_nonfinite(tmp_path) == {0: (6, "")}
    assert not (tmp_path / protocol.REPLAY_DIR).exists()


# ------------------------------------------------------------------------- the layout
def run_task(argv, procid, localid):
    env = dict(os.environ, SLURM_PROCID=str(procid), SLURM_LOCALID=str(localid))
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("rotate", [0, 1, 2])
def test_rotated_ranks_run_where_the_next_nodes_ranks_ran(rotate):
    """3 nodes x 2 ranks: the generated per-task command gives the task with SLURM_PROCID p the
    rank the supervisor's rank_node puts on that task's node."""
    s = Supervisor(Policy(nodes=3, ranks_per_node=2, preflight=None, liveness_check=False), NODES)
    s.start(now=0.0)
    s.rotate = rotate
    argv = rank_env_command(["sh", "-c", 'echo "$RANK" "$NODE_RANK" "$LOCAL_RANK"'], 6, 2, rotate)
    for p in range(6):
        rank, node_rank, local = map(int, run_task(argv, p, p % 2))
        assert local == p % 2 and node_rank == rank // 2
        assert s.rank_node(rank) == NODES[p // 2], (rotate, p, rank)
    if rotate == 0:
        assert [int(run_task(argv, p, p % 2)[0]) for p in range(6)] == list(range(6))


def test_torchrun_node_rank_rotates_the_same_way():
    argv = torchrun_command(["python", "train.py"], "python", 3, 2, rotate=1)
    body = argv[2].replace('exec "$0" -m torch.distributed.run', 'echo').split(";")[-1]
    env_argv = ["bash", "-c", body] + argv[3:]
    got = [run_task(env_argv, p, 0) for p in range(3)]
    assert [g[2] for g in got] == ["--node-rank=2", "--node-rank=0", "--node-rank=1"]


def test_replay_for_a_script_without_the_sdk_is_refused_with_exit_2(tmp_path, monkeypatch, capsys):
    from clusterops.cli import main

    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    script = tmp_path / "t.py"
    script.write_text("print('step=1 loss=1.0')\n")
    spec = {"name": "r", "nodes": 2, "launcher": "srun", "script": str(script),
            "supervise": {"progress": {"regex": r"step=(\d+)", "loss_regex": r"loss=(\S+)"},
                          "stability": {"on_nan": "replay"}}}
    with pytest.raises(SystemExit) as e:
        main(["supervise", "--job-dir", str(tmp_path / "jd"), "--spec-json", json.dumps(spec), "--", "true"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "supervise.stability.on_nan: replay needs a script that uses the SDK" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "jd").exists()


def test_a_one_node_job_replays_on_a_spare_and_then_names_its_node():
    s = Supervisor(Policy(nodes=1, spare_nodes=1, preflight=None, liveness_check=False), ["node1", "node2"],
                   stability=StabilityConfig(on_nan="replay", warmup_steps=0, min_samples=3, patience=1))
    s.start(now=0.0)
    s.handle(ResumeChosen(0.5, None, ""))
    s.handle(StepLaunched(1.0))
    s.handle(CheckpointCommitted(2.0, 10, "/ck/10"))
    s.handle(Heartbeats(3.0, {0: (12, 3.0)}, signals={0: (12, 1.0, None)}))
    s.handle(Heartbeats(4.0, {0: (14, 4.0)}, signals={0: (14, math.nan, None)}, nonfinite={0: (13, "node1")}))
    s.handle(StepExited(5.0, returncode=137, ckpt_step=10))
    acts = s.handle(sv.RollbackPicked(5.0, 10, "/ck/10"))
    launch = only(acts, Launch)[0]
    assert launch.nodes == ("node2",) and launch.rotate == 0
    assert records(acts, "launch")[0]["replay"]["placement"] == "spare"
    acts = s.handle(StepExited(9.0, returncode=0, ckpt_step=10, replay={0: report(16)}))
    dec = records(acts, "replay_decided")[0]
    assert dec["verdict"] == "hardware" and dec["node"] == "node1", dec
    assert only(acts, Launch)[0].nodes == ("node2",) and [r["node"] for r in records(acts, "node_bad")] == ["node1"]
