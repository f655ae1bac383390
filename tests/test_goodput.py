"""Goodput and time lost by cause, from synthetic timelines with known answers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.supervisor import timeline as tl

CLUSTEROPS = str(Path(sys.executable).with_name("clusterops"))


def rec(t, event, **kw):
    return {"t": float(t), "event": event, "job_id": "9", **kw}


def test_startup_and_checkpoint_stall():
    recs = [rec(0, "launch"), rec(5, "progress", step=0), rec(15, "progress", step=10),
            rec(25, "progress", step=20), rec(35, "progress", step=30), rec(36, "checkpoint", step=30),
            rec(50, "progress", step=40), rec(60, "progress", step=50), rec(60, "done", code=0),
            rec(70, "warning", what="late")]
    r = tl.goodput_report(recs)
    # 1 s/step; the interval with the checkpoint took 15 s for 10 steps: 5 s stall
    assert r["seconds_per_step"] == 1.0
    assert r["wall_s"] == 70 and r["productive_s"] == 50
    assert r["lost_s"] == {"startup": 5, "restart": 0, "inprocess": 0, "requeue_wait": 0, "recomputed": 0,
                           "checkpoint_stall": 5, "stalled": 0, "other": 10}
    assert r["goodput"] == pytest.approx(50 / 70)
    assert r["restarts"] == 0 and r["recoveries"] == 0 and r["mttr_s"] is None


def test_requeue_wait_restart_and_mttr():
    recs = [rec(0, "launch", resume_step=0), rec(10, "progress", step=10), rec(20, "progress", step=20),
            rec(25, "node_down", node="n2"), rec(30, "requeue", cause="node_down"),
            rec(100, "launch", resume_step=20, incarnation=1), rec(110, "progress", step=30),
            rec(110, "done", code=0)]
    r = tl.goodput_report(recs)
    assert r["productive_s"] == 30
    # 20..25 silent before the fault + 25..30 deciding = restart; 30..100 waiting in the queue
    assert r["lost_s"]["restart"] == 10 and r["lost_s"]["requeue_wait"] == 70
    assert r["lost_s"]["recomputed"] == 0
    assert r["restarts"] == 1 and r["recoveries"] == 1 and r["mttr_s"] == 85


def test_recomputed_steps_after_resuming_from_an_older_checkpoint():
    recs = [rec(0, "launch", resume_step=0), rec(40, "progress", step=40), rec(50, "step_exit", cause="crash"),
            rec(51, "restart", cause="crash"), rec(60, "launch", resume_step=20),
            rec(70, "progress", step=30), rec(90, "progress", step=50), rec(90, "done", code=0)]
    r = tl.goodput_report(recs)
    # 20..40 redone: 60..70 (20->30) entirely, 70..90 (30->50) half (30->40 redone, 40->50 new)
    assert r["lost_s"]["recomputed"] == 20
    assert r["productive_s"] == 40 + 10
    assert r["lost_s"]["restart"] == 20      # 40..50 silent, 50..60 restarting
    assert r["goodput"] == pytest.approx(50 / 90)
    assert r["mttr_s"] == 20                 # crash at 50, first advancing progress at 70


def test_stall_without_fault_is_stalled():
    recs = [rec(0, "launch", resume_step=0), rec(10, "progress", step=10), rec(30, "progress", step=10),
            rec(40, "progress", step=20), rec(40, "done", code=0)]
    r = tl.goodput_report(recs)
    assert r["productive_s"] == 20 and r["lost_s"]["stalled"] == 20


def test_no_launch_no_report():
    assert tl.goodput_report([rec(0, "progress", step=3)]) is None
    assert tl.goodput([]) is None


def test_random_timelines_account_for_all_wall_time():
    rnd = random.Random(7)
    kinds = ["progress"] * 6 + ["checkpoint", "heartbeat_lost", "restart", "requeue", "launch", "warning"]
    for _ in range(300):
        t, step, recs = 0.0, 0, [rec(0, "launch", resume_step=0)]
        for _ in range(rnd.randint(1, 40)):
            t += rnd.choice([0, 0.5, 1, 3, 10])
            k = rnd.choice(kinds)
            if k == "progress":
                step += rnd.choice([0, 1, 5])
                recs.append(rec(t, k, step=step))
            elif k == "launch":
                step = rnd.randint(0, step)
                recs.append(rec(t, k, resume_step=step))
            else:
                recs.append(rec(t, k, step=step))
        r = tl.goodput_report(recs)
        total = r["productive_s"] + sum(r["lost_s"].values())
        assert total == pytest.approx(r["wall_s"], abs=1e-2), (recs, r)
        assert all(v >= 0 for v in r["lost_s"].values()) and 0 <= r["goodput"] <= 1


def test_cli_json_text_html_and_prometheus(tmp_path):
    recs = [rec(0, "launch", resume_step=0), rec(10, "progress", step=10), rec(20, "progress", step=20),
            rec(25, "node_down", node="n2"), rec(30, "requeue", cause="node_down"),
            rec(100, "launch", resume_step=20), rec(110, "progress", step=30), rec(110, "done", code=0)]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = subprocess.run([CLUSTEROPS, "job", "timeline", str(tmp_path), "--json"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    g = json.loads(p.stdout)["summary"]["goodput"]
    assert g["productive_s"] == 30 and g["lost_s"]["requeue_wait"] == 70 and g["mttr_s"] == 85
    p = subprocess.run([CLUSTEROPS, "job", "timeline", str(tmp_path), "--chart", str(tmp_path / "c.html"),
                        "--prometheus", str(tmp_path / "j.prom")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "-- goodput 27.3% (30.0s productive of 110.0s wall)" in p.stdout
    assert "requeue_wait 70.0s" in p.stdout and "MTTR 85.0s" in p.stdout
    assert "<table class='goodput'>" in (tmp_path / "c.html").read_text()
    prom = (tmp_path / "j.prom").read_text()
    assert 'clusterops_job_lost_seconds{cause="requeue_wait",job="9"} 70.0' in prom
    assert 'clusterops_job_mttr_seconds{job="9"} 85.0' in prom


# -- in-process recovery: its own cause, and its phases -----------------------------------
def healed_run(mid_step=None):
    """4 s/40 steps, a rank lost at 4.0 (heard then; the supervisor's loop wrote the records
    later, at t), healed in-process: first survivor rejoined 4.1, plan 4.4, state 4.6, the new
    generation's first step 4.8. ``mid_step``: a progress sample taken during the recovery."""
    recs = [rec(0, "launch", resume_step=0), rec(1, "progress", step=0), rec(3, "progress", step=20),
            rec(4.3, "inproc_fault", gen=0, first="rank 2 lost", at=4.0),
            rec(4.5, "inproc_rendezvous", gen=1, wait_s=0.4, abort_s=0.1, src=0, step=23, at=4.4),
            rec(4.7, "inproc_state", gen=1, seconds=0.05, at=4.6),
            rec(5, "progress", step=25),
            rec(5.1, "inproc_first_step", gen=1, step=24, fault_to_step_s=0.8, at=4.8),
            rec(7, "progress", step=45), rec(7, "done", code=0)]
    if mid_step is not None:
        recs.insert(4, rec(4.5, "progress", step=mid_step))
    return recs


def test_a_fault_healed_in_process_is_its_own_cause_and_the_steps_around_it_stay_productive():
    r = tl.goodput_report(healed_run())
    assert r["lost_s"]["inprocess"] == pytest.approx(0.8)     # 4.0 (heard) .. 4.8 (first step)
    assert r["lost_s"]["restart"] == 0 and r["restarts"] == 0
    # 3..5 advanced 20 -> 25 (one launch, nothing redone): 2 s less the 0.8 s recovering
    assert r["productive_s"] == pytest.approx(2 + 1.2 + 2)
    assert r["lost_s"]["startup"] == 1
    assert r["productive_s"] + sum(r["lost_s"].values()) == pytest.approx(r["wall_s"])
    assert r["mttr_s"] == pytest.approx(0.8) and r["recoveries"] == 1
    assert r["inprocess"] == {"recoveries": 1, "phases_s": {"abort": 0.1, "rendezvous": 0.3, "state": 0.2,
                                                            "first_step": 0.2}}
    assert "inprocess 0.8s" in tl.format_goodput(r) and "healed in-process 1" in tl.format_goodput(r)


def test_a_sample_during_the_recovery_splits_it_but_not_its_cause():
    # A sample at the fault's step (23) at 4.5 cuts the window in two intervals, both advancing.
    r = tl.goodput_report(healed_run(mid_step=23))
    assert r["lost_s"]["inprocess"] == pytest.approx(0.8)
    assert r["productive_s"] == pytest.approx(2 + (1.5 - 0.5) + (0.5 - 0.3) + 2)
    # A sample that did not advance (step 20 again): the gap is not an advancing interval, and
    # its part in the recovery is still in-process time, the rest of it unexplained.
    r = tl.goodput_report(healed_run(mid_step=20))
    assert r["lost_s"]["inprocess"] == pytest.approx(0.8)
    assert r["productive_s"] + sum(r["lost_s"].values()) == pytest.approx(r["wall_s"])


def test_a_fault_that_fell_back_is_a_restart_not_in_process():
    recs = [rec(0, "launch", resume_step=0), rec(1, "progress", step=0), rec(3, "progress", step=20),
            rec(4.0, "inproc_fault", gen=0, first="rank 2 lost", at=4.0),
            rec(4.2, "inproc_rendezvous", gen=1, wait_s=0.2, abort_s=0.1, src=0, step=23, at=4.2),
            rec(5.0, "inproc_fallback", reason="rank 2 failed a second time"),
            rec(6.0, "step_exit", cause="rank_killed"), rec(6.5, "restart", cause="rank_killed"),
            rec(8.0, "launch", resume_step=20), rec(10.0, "progress", step=40), rec(10.0, "done", code=0)]
    r = tl.goodput_report(recs)
    assert tl.inprocess_windows(recs) == []
    assert r["lost_s"]["inprocess"] == 0 and r["inprocess"]["recoveries"] == 0
    assert r["lost_s"]["restart"] == pytest.approx(1 + 4)      # 3..4 silent before the fault, 4..8 relaunching
    assert r["productive_s"] == pytest.approx(2 + 2)


def test_phases_missing_or_out_of_order_give_their_phase_no_time():
    # Written by an older supervisor: no at, no abort_s: the spans come from the record times.
    recs = [rec(0, "launch", resume_step=0), rec(1, "progress", step=10), rec(2, "inproc_fault", gen=0),
            rec(2.5, "inproc_first_step", gen=1, step=11, fault_to_step_s=0.5), rec(3, "progress", step=20)]
    (w,) = tl.inprocess_windows(recs)
    assert (w["start"], w["end"]) == (2, 2.5)
    assert [(n, a, b) for n, a, b in w["phases"]] == [("abort", 2, 2), ("rendezvous", 2, 2), ("state", 2, 2),
                                                     ("first_step", 2, 2.5)]
    assert tl.goodput_report(recs)["lost_s"]["inprocess"] == pytest.approx(0.5)


def test_the_chart_draws_each_phase_of_an_in_process_recovery():
    recs = healed_run()
    svg = tl.render_svg(recs)
    bands = [line for line in svg.splitlines() if 'class="inproc-phase"' in line]
    assert [b.split('data-phase="')[1].split('"')[0] for b in bands] == ["abort", "rendezvous", "state",
                                                                          "first_step"]
    assert "rendezvous 0.300 s" in bands[1] and 'class="inproc-legend"' in svg
    assert 'class="inproc-phase"' not in tl.render_svg(recs[:3] + recs[-2:])   # no recovery, no band
    html = tl.render_html(recs)
    assert "in-process recoveries</td><td>1" in html and "in-process: first step</td><td>0.200 s" in html


RECORDED = Path(__file__).parent / "fixtures" / "timelines" / "inprocess_refill.jsonl"


def test_recorded_timeline_two_faults_healed_in_process():
    """The timeline of tests/integration/test_inprocess.py's refill test, as the supervisor
    wrote it on the dev cluster (2 nodes x 2 ranks; rank 2 SIGKILLed at step 15, rank 3 at
    step 45, both healed in-process on node2, the second by the refilled standby)."""
    recs = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    windows = tl.inprocess_windows(recs)
    healed = [r for r in recs if r["event"] == "inproc_first_step"]
    assert len(windows) == 2 == len(healed)
    for w, h in zip(windows, healed):
        assert w["end"] - w["start"] == pytest.approx(h["fault_to_step_s"], abs=1e-6)
        assert sum(b - a for _, a, b in w["phases"]) == pytest.approx(h["fault_to_step_s"], abs=1e-6)
        assert all(b >= a for _, a, b in w["phases"])
        rdzv = next(r for r in recs if r["event"] == "inproc_rendezvous" and r["gen"] == h["gen"])
        assert dict((n, b - a) for n, a, b in w["phases"])["abort"] == pytest.approx(rdzv["abort_s"], abs=1e-6)
    r = tl.goodput_report(recs)
    assert r["restarts"] == 0 and r["inprocess"]["recoveries"] == 2
    assert r["lost_s"]["inprocess"] == pytest.approx(sum(h["fault_to_step_s"] for h in healed), abs=1e-3)
    assert r["productive_s"] + sum(r["lost_s"].values()) == pytest.approx(r["wall_s"], abs=1e-3)
    assert r["mttr_s"] == pytest.approx(sum(h["fault_to_step_s"] for h in healed) / 2, abs=1e-3)
    # The same run read the old way (the faults as relaunches) loses more and heals nothing in-process.
    old = [x for x in recs if not x["event"].startswith("inproc_") or x["event"] == "inproc_fault"]
    r_old = tl.goodput_report(old)
    assert r_old["inprocess"]["recoveries"] == 0 and r_old["productive_s"] < r["productive_s"]
    svg = tl.render_svg(recs)
    assert svg.count('class="inproc-phase"') == 8
