"""Stragglers inside a running job: the detector and the state machine's replacement, with
synthetic beats (a fake clock); the busy time on the heartbeat datagram and in the SDK."""

from __future__ import annotations

import random

import pytest

from clusterops import heartbeat as hbc
from clusterops.supervisor import (DrainNodes, Heartbeats, KillStep, Launch, Record, Requeue, RequestStop,
                                   StepExited, StepLaunched, StopRequested, Tick)
from clusterops.supervisor.stragglers import Detector, median
from test_supervisor import P, only, records, start

NODES4 = ["node1", "node2", "node3", "node4"]


class Job:
    """A synchronous job: every rank is at the same step; per beat (one a second) each rank
    reports its busy time per step (``busy(rank, beat)``, ms; None: -1)."""

    def __init__(self, ranks: int, steps_per_beat: int = 5):
        self.ranks = ranks
        self.steps_per_beat = steps_per_beat
        self.step = 0
        self.beat = 0

    def timing(self, busy, step_ms=None):
        self.step += self.steps_per_beat
        self.beat += 1
        out = {}
        for r in range(self.ranks):
            b = busy(r, self.beat)
            sms = step_ms(r, self.beat) if step_ms else 200
            out[r] = (self.step, sms if sms is not None else -1, -1 if b is None else int(b))
        return out


def feed_detector(det, job, beats, busy, step_ms=None):
    found = []
    for _ in range(beats):
        found += [(job.beat + 1, f) for f in det.feed(job.timing(busy, step_ms))]
    return found


def node_of(ranks_per_node, nodes):
    return lambda r: nodes[r // ranks_per_node] if 0 <= r // ranks_per_node < len(nodes) else None


# ---------------------------------------------------------------- the detector
def test_median():
    assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_a_slow_node_is_found_after_a_sustained_slowdown_not_before():
    det = Detector(node_of(2, NODES4), ratio=1.5, window=5, warmup_steps=10)
    job = Job(ranks=8)
    slow = {4, 5}                                            # node3's two ranks
    found = feed_detector(det, job, 40, lambda r, b: 250 if r in slow else 100)
    assert len(found) == 1, found
    beat, f = found[0]
    assert f.node == "node3" and f.measure == "busy" and f.ranks == (4, 5)
    assert f.ratio == 2.5 and f.node_ms == 250 and f.others_ms == 100
    # Warm-up (2 beats of 5 steps), then `window` samples, then `window` slow evaluations.
    assert 2 + 5 + 4 <= beat <= 2 + 5 + 5 + 1, beat
    assert det.slowest() == ("node3", 2.5)


def test_one_slow_rank_among_several_on_a_node_is_not_enough_when_the_median_holds():
    # The node's figure is the median over its ranks' samples: 1 slow rank of 4 does not make it slow.
    det = Detector(node_of(4, ["a", "b"]), ratio=1.5, window=4, warmup_steps=0)
    job = Job(ranks=8)
    assert feed_detector(det, job, 30, lambda r, b: 400 if r == 1 else 100) == []


def test_checkpoint_pauses_are_not_flagged():
    det = Detector(node_of(1, NODES4), ratio=1.5, window=5, warmup_steps=10)
    job = Job(ranks=4)

    def busy(r, b):
        if b % 10 == 0:
            return None             # the SDK says: a save fell in this interval (-1)
        if b % 10 == 1 and r == 0:
            return 900              # rank 0 writes the manifest: an unreported spike, one beat
        return 100
    assert feed_detector(det, job, 120, busy, step_ms=lambda r, b: None if b % 10 == 0 else 200) == []


def test_warm_up_steps_are_not_flagged():
    def busy(r, b):
        return 1000 if r == 2 and b <= 10 else 100     # slow for the first 10 beats (50 steps)

    det = Detector(node_of(1, NODES4), ratio=1.5, window=5, warmup_steps=50)
    assert feed_detector(det, Job(ranks=4), 60, busy) == []
    # The same beats without the warm-up allowance name the node: the allowance is what holds.
    det = Detector(node_of(1, NODES4), ratio=1.5, window=5, warmup_steps=0)
    assert [f.node for _, f in feed_detector(det, Job(ranks=4), 60, busy)] == ["node3"]


def test_warm_up_counts_from_the_first_beat_of_each_launch():
    det = Detector(node_of(1, NODES4), ratio=1.5, window=3, warmup_steps=20)
    job = Job(ranks=4)
    job.step = 5000            # a resume: warm-up is relative to where the launch started
    found = feed_detector(det, job, 5, lambda r, b: 900 if r == 3 else 100)
    assert found == []
    assert det.first_step == {r: 5005 for r in range(4)}


@pytest.mark.parametrize("seed", range(5))
def test_noise_is_not_flagged(seed):
    rnd = random.Random(seed)
    det = Detector(node_of(2, NODES4), ratio=1.5, window=10, warmup_steps=20)
    job = Job(ranks=8)
    # +-30 % noise on every rank, and now and then a 3x hiccup of one rank.
    found = feed_detector(det, job, 600, lambda r, b: 100 * rnd.uniform(0.7, 1.3) * (3 if rnd.random() < 0.03 else 1))
    assert found == [], found


def test_small_absolute_differences_are_noise():
    det = Detector(node_of(1, ["a", "b", "c"]), ratio=1.5, window=3, warmup_steps=0)
    job = Job(ranks=3)
    assert feed_detector(det, job, 30, lambda r, b: 4 if r == 0 else 1) == []   # 4 ms vs 1 ms


def test_without_busy_time_a_synchronous_job_flags_nothing_and_an_asynchronous_one_by_step_time():
    det = Detector(node_of(1, NODES4), ratio=1.5, window=4, warmup_steps=0)
    assert feed_detector(det, Job(ranks=4), 30, lambda r, b: None) == []     # equal step times
    det = Detector(node_of(1, NODES4), ratio=1.5, window=4, warmup_steps=0)
    found = feed_detector(det, Job(ranks=4), 30, lambda r, b: None, step_ms=lambda r, b: 600 if r == 1 else 200)
    assert [(f.node, f.measure) for _, f in found] == [("node2", "step")]


def test_one_node_alone_is_never_a_straggler():
    det = Detector(node_of(4, ["a"]), ratio=1.5, window=2, warmup_steps=0)
    assert feed_detector(det, Job(ranks=4), 20, lambda r, b: 900 if r == 0 else 100) == []


def test_stale_beats_are_not_new_samples():
    det = Detector(node_of(1, ["a", "b"]), ratio=1.5, window=2, warmup_steps=0)
    same = {0: (10, 200, 900), 1: (10, 200, 100)}
    for _ in range(20):
        assert det.feed(same) == []           # the same step again: no sample
    assert not any(det.busy.values()) and not any(det.steps.values())


# ---------------------------------------------------------------- the state machine
def beats_for(s, job, busy, t0, n, *, dt=1.0):
    """Feed n heartbeat snapshots (one a second) to supervisor s; all actions out."""
    out = []
    for i in range(n):
        now = t0 + i * dt
        timing = job.timing(busy)
        out += s.handle(Heartbeats(now, {r: (st, now) for r, (st, _, _) in timing.items()}, timing=timing))
    return out


def straggler_policy(**kw):
    kw.setdefault("straggler_window", 4)
    kw.setdefault("straggler_warmup_steps", 10)
    return P(**kw)


def test_noisy_job_records_no_straggler_and_runs_to_its_end():
    rnd = random.Random(7)
    s, acts = start(straggler_policy(nodes=3, spare_nodes=1, replace_stragglers=True))
    s.handle(StepLaunched(1000.0))
    job = Job(ranks=3)
    acts = beats_for(s, job, lambda r, b: 100 * rnd.uniform(0.75, 1.25), 1001.0, 300)
    assert not records(acts, "straggler") and not only(acts, RequestStop), acts
    assert only(s.handle(StepExited(1400.0, returncode=0, ckpt_step=1500)), Launch) == []
    assert s.exit_code == 0


def test_straggler_is_recorded_only_when_replacement_is_off():
    s, _ = start(straggler_policy(nodes=3, spare_nodes=1, drain_bad_nodes=True))
    s.handle(StepLaunched(1000.0))
    acts = beats_for(s, Job(ranks=3), lambda r, b: 300 if r == 1 else 100, 1001.0, 30)
    recs = records(acts, "straggler")
    assert len(recs) == 1 and recs[0].data["node"] == "node2" and recs[0].data["action"] == "record"
    assert recs[0].data["why"] == "replace_stragglers is off" and recs[0].data["ratio"] == 3.0
    assert not only(acts, RequestStop) and not only(acts, DrainNodes) and s.state == "running"
    # Progress samples carry the slowest node's ratio (the metrics gauge).
    assert records(acts, "progress")[-1].data["slowest"] == ["node2", 3.0]


def test_straggler_without_a_spare_is_recorded_and_the_job_never_stopped():
    s, _ = start(straggler_policy(nodes=4, replace_stragglers=True))
    s.handle(StepLaunched(1000.0))
    acts = beats_for(s, Job(ranks=4), lambda r, b: 300 if r == 3 else 100, 1001.0, 40)
    recs = records(acts, "straggler")
    assert [(r.data["node"], r.data["action"], r.data["why"]) for r in recs] == [("node4", "record", "no spare node")]
    assert not only(acts, RequestStop) and not only(acts, KillStep) and s.state == "running"


def replaced(drain=True):
    """A 3+1 job whose node2 is slow, replaced: (supervisor, actions up to the stop, stop step)."""
    s, acts = start(straggler_policy(nodes=3, spare_nodes=1, replace_stragglers=True, drain_bad_nodes=drain))
    assert only(acts, Launch)[0].nodes == ("node1", "node2", "node3")
    s.handle(StepLaunched(1000.0))
    job = Job(ranks=3)
    acts = beats_for(s, job, lambda r, b: 300 if r == 1 else 100, 1001.0, 30)
    return s, acts, job


def test_straggler_with_a_spare_is_replaced_at_a_planned_stop_with_no_step_lost():
    s, acts, job = replaced()
    rec = records(acts, "straggler")
    assert len(rec) == 1 and rec[0].data["action"] == "replace" and rec[0].data["spare"] == "node4"
    assert only(acts, RequestStop) == [RequestStop("straggler")] and s.state == "stopping"
    n_beats = len(acts)
    # No more findings or stops while it stops.
    assert not only(beats_for(s, job, lambda r, b: 300 if r == 1 else 100, 1100.0, 10), RequestStop)
    # The ranks agree on a step, save it and exit 0 with the stopped marker.
    stop_step = job.step
    acts = s.handle(StepExited(1120.0, returncode=0, ckpt_step=stop_step, stopped_by="signal"))
    stopped = records(acts, "stopped")
    assert stopped and stopped[0].data["ckpt_step"] == stop_step and stopped[0].data["reason"] == "straggler"
    bad = records(acts, "node_bad")
    assert bad and bad[0].data["node"] == "node2" and bad[0].data["why"].startswith("straggler: busy time 3")
    drains = only(acts, DrainNodes)
    assert drains and drains[0].nodes == ("node2",) and drains[0].reason.startswith("clusterops:straggler: busy time 3")
    launch = only(acts, Launch)
    assert launch and launch[0].nodes == ("node1", "node3", "node4")
    assert records(acts, "spare_used")[0].data["nodes"] == ["node4"]
    assert records(acts, "launch")[0].data["resume_step"] == stop_step        # 0 steps lost
    assert records(acts, "restart")[0].data["cause"] == "straggler"
    assert s.memory.restarts == 0 and s.memory.no_progress == 0              # a planned stop is no failure
    assert "node2" in s.memory.bad_nodes and not only(acts, Requeue)
    assert s.state == "running" and s.stop_reason is None and n_beats


def test_the_replaced_node_stays_out_of_later_incarnations():
    s, _, job = replaced(drain=False)
    s.handle(StepExited(1120.0, returncode=0, ckpt_step=job.step, stopped_by="signal"))
    from clusterops.supervisor import Memory, Supervisor

    memory = Memory.from_dict(s.memory.to_dict())       # what supervisor-state.json keeps
    s2 = Supervisor(straggler_policy(nodes=3, spare_nodes=1), NODES4, slurm_restart_count=1, memory=memory)
    assert only(s2.start(2000.0), Launch)[0].nodes == ("node1", "node3", "node4")


def test_no_drain_for_a_straggler_unless_the_policy_drains():
    s, _, job = replaced(drain=False)
    acts = s.handle(StepExited(1120.0, returncode=0, ckpt_step=job.step, stopped_by="signal"))
    assert not only(acts, DrainNodes) and only(acts, Launch)


def test_a_planned_stop_that_times_out_is_killed_and_relaunched_without_the_node():
    s, _, job = replaced()
    acts = s.handle(Tick(1001.0 + 30 + 200.0))      # past stop_timeout_s
    assert records(acts, "stop_timeout") and only(acts, KillStep)
    acts = s.handle(StepExited(1300.0, returncode=137, ckpt_step=10, failures=()))
    assert not only(acts, Requeue)
    assert only(acts, Launch)[0].nodes == ("node1", "node3", "node4")
    assert s.memory.restarts == 1          # killed: this one counts as a failed attempt


def test_a_time_limit_during_the_planned_stop_requeues_without_the_node():
    s, _, job = replaced()
    acts = s.handle(StopRequested(1040.0, "time_limit"))
    assert not only(acts, RequestStop)     # the ranks are saving already
    acts = s.handle(StepExited(1050.0, returncode=0, ckpt_step=job.step, stopped_by="signal"))
    req = only(acts, Requeue)
    assert req and "node2" in req[0].exclude and not only(acts, Launch)


def test_a_clean_exit_without_the_stopped_marker_is_relaunched_not_taken_for_the_end():
    # It may have finished, or be a script that stops without the marker: relaunching from the
    # latest checkpoint is right either way; ending the job could drop the rest of its training.
    s, _, job = replaced()
    acts = s.handle(StepExited(1050.0, returncode=0, ckpt_step=job.step))
    assert s.exit_code is None and only(acts, Launch)[0].nodes == ("node1", "node3", "node4")


def test_detection_off():
    s, _ = start(straggler_policy(nodes=3, spare_nodes=1, detect_stragglers=False, replace_stragglers=True))
    s.handle(StepLaunched(1000.0))
    acts = beats_for(s, Job(ranks=3), lambda r, b: 900 if r == 1 else 100, 1001.0, 40)
    assert not records(acts, "straggler") and not only(acts, RequestStop)


# ---------------------------------------------------------------- the datagram and the SDK
def test_busy_times_ride_on_the_datagram_and_old_datagrams_still_decode():
    d = hbc.Datagram("tok", "n1", 3, (hbc.RankBeat(0, 10, 5, 200, 120), hbc.RankBeat(1, 10, 7, 200, 60)))
    data = hbc.encode(d)
    assert b'"busy":[120,60]' in data
    assert hbc.decode(data) == d
    old = hbc.Datagram("tok", "n1", 3, (hbc.RankBeat(0, 10, 5, 200),))
    assert b"busy" not in hbc.encode(old)             # an old receiver reads it as before
    assert hbc.decode(hbc.encode(old)).ranks[0].busy_ms == -1
    with pytest.raises(hbc.BadDatagram, match="busy"):
        hbc.decode(data.replace(b'"busy":[120,60]', b'"busy":[120]'))


def test_sender_reports_busy_per_step_and_nothing_for_an_interval_with_a_save(tmp_path):
    clock = [100.0]
    s = hbc.NodeSender("file/" + "ab" * 16, str(tmp_path), 0, node="n1", root=str(tmp_path / "shm"),
                       clock=lambda: clock[0])
    s.beat(10)
    clock[0] = 101.0
    s.beat(20, busy_s=0.4)
    beat = s.collect(101.0)[0]
    assert (beat.step, beat.step_ms, beat.busy_ms) == (20, 100, 40)
    clock[0] = 102.0
    s.beat(30, busy_s=0.4, paused=True)
    beat = s.collect(102.0)[0]
    assert (beat.step_ms, beat.busy_ms) == (-1, -1)


def test_sdk_compute_blocks_become_the_busy_time_of_the_beat(tmp_path, monkeypatch):
    import time

    from clusterops import protocol, sdk

    sdk._reset()
    hb = tmp_path / "hb"
    hb.mkdir()
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(hb))
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_ADDR, f"{protocol.HEARTBEAT_ADDR_FILE}/{'ab' * 16}")  # with a token
    monkeypatch.setenv("SLURMD_NODENAME", "nx")
    monkeypatch.setattr(hbc, "local_root", lambda: str(tmp_path / "shm"))
    try:
        sdk.heartbeat(0, force=True)
        for _ in range(4):
            with sdk.compute():
                with sdk.compute():          # nested: counted once
                    time.sleep(0.05)
            time.sleep(0.05)                 # "waiting": not busy
        sdk.heartbeat(4, force=True)
        beat = sdk._rt.hb_sender.collect(time.time())[0]
        assert 45 <= beat.busy_ms < 95 and beat.step_ms >= 95, beat
    finally:
        sdk._reset()


def test_median_of_the_others_matches_the_plain_way():
    from clusterops.supervisor.stragglers import _median_without

    rnd = random.Random(3)
    for n in range(2, 40):
        values = sorted(rnd.choice([rnd.uniform(0, 100), 50.0]) for _ in range(n))
        for i, v in enumerate(values):
            assert _median_without(values, v) == median(values[:i] + values[i + 1:])


# ---------------------------------------------------------------- the timeline and the metrics
STORY = [
    {"t": 1.0, "event": "launch", "nodes": ["node1", "node2"], "resume_step": None},
    {"t": 5.0, "event": "progress", "step": 40, "max_step": 40, "ranks": 2, "slowest": ["node2", 2.4]},
    {"t": 6.0, "event": "straggler", "node": "node2", "ratio": 2.382, "measure": "busy", "node_ms": 243.0,
     "others_ms": 102.0, "ranks": [1], "step": 41, "action": "replace", "spare": "node3"},
    {"t": 7.0, "event": "progress", "step": 45, "max_step": 45, "ranks": 2, "slowest": ["node2", 2.5]},
    {"t": 9.0, "event": "straggler", "node": "node4", "ratio": 1.9, "measure": "busy", "node_ms": 190.0,
     "others_ms": 100.0, "ranks": [3], "step": 90, "action": "record", "why": "no spare node"},
]


def test_the_straggler_event_in_text_json_summary_chart_and_metrics():
    from clusterops.supervisor import timeline as tl

    text = tl.format_text(STORY)
    assert ("straggler node2: busy time 2.382x the other nodes' median (243.0 vs 102.0 ms/step, ranks 1); "
            "replacing it with node3 at a checkpoint") in text
    assert "straggler node4: busy time 1.9x" in text and "recorded only (no spare node)" in text
    assert tl.summary(STORY)["stragglers"] == [{"node": "node2", "ratio": 2.382, "action": "replace"},
                                               {"node": "node4", "ratio": 1.9, "action": "record"}]
    svg = tl.render_svg(STORY)
    assert svg.count('class="finding" data-event="straggler"') == 2 and ">straggler</text>" in svg
    prom = tl.prometheus_text(STORY, "j")
    assert 'clusterops_job_stragglers{job="j"} 2.0' in prom
    assert 'clusterops_job_stragglers_replaced{job="j"} 1.0' in prom
    # Each straggler's ratio when found; the slowest node's from the latest progress sample.
    assert 'clusterops_job_node_slowness_ratio{job="j",node="node2"} 2.5' in prom
    assert 'clusterops_job_node_slowness_ratio{job="j",node="node4"} 1.9' in prom
    assert "straggler" not in tl.render_svg(STORY[:2])     # no legend entry without one
