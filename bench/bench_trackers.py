#!/usr/bin/env python3
"""The experiment trackers' cost (clusterops.trackers), with the real libraries, no cluster.

    python bench/bench_trackers.py [--records 2000] [--reps 3] [--json FILE]

Figures (median over ``--reps``):
  feed us/record   what the supervisor's own thread pays per timeline record with all three
                   trackers on (``TrackerSink.feed``: a queue put), microseconds
  open s           per tracker, the worker's start (import, W&B offline run, MLflow sqlite
                   store and run, TensorBoard writer), seconds; never on the supervisor's thread
  ms/record        per tracker, the worker's time per record written (a progress record with
                   a loss every time, a marker every 50 records), open and close excluded
  close s          per tracker, the end of its run (W&B's finish, MLflow's status, the last flush)

A supervised job writes a progress record every ``progress_interval_s`` (2 s): the worker's
time per record is to be read against that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from clusterops import trackers  # noqa: E402


def records(n: int, t0: float):
    out = [{"t": t0, "event": "launch", "job_id": "1", "incarnation": 0, "attempt": 1, "resume_step": None}]
    for i in range(1, n):
        if i % 50 == 0:
            out.append({"t": t0 + i, "event": "restart", "job_id": "1", "incarnation": 0, "reason": "bench"})
        else:
            out.append({"t": t0 + i, "event": "progress", "job_id": "1", "incarnation": 0, "step": i,
                        "loss": 1.0 / i})
    return out


def one_tracker(kind: str, n: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        job = Path(d)
        t = trackers.TRACKERS[kind](trackers.TrackerSpec(kind).resolved(job, "bench", "1"), "1")
        a = time.perf_counter()
        t.open({})
        b = time.perf_counter()
        fig = trackers.Figures()
        for i, rec in enumerate(records(n, time.time())):
            item = fig.take(rec)
            if item is not None:
                t.write(item)
                if item.marker:
                    t.flush(fig.markers)
        t.flush(fig.markers)
        c = time.perf_counter()
        t.close("done")
        e = time.perf_counter()
    return {"open_s": b - a, "ms_per_record": (c - b) * 1000 / n, "close_s": e - c}


def feed_cost(n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        specs = trackers.parse([{"kind": "tensorboard"}, {"kind": "wandb"}, {"kind": "mlflow"}])
        sink = trackers.TrackerSink(specs, Path(d), job_name="bench", job_id="1", warn=print)
        sink.start([])
        recs = records(n, time.time())
        a = time.perf_counter()
        for r in recs:
            sink.feed(r)
        us = (time.perf_counter() - a) * 1e6 / n
        sink.close("done", wait_s=600)
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out: dict = {"records": a.records, "reps": a.reps, "feed_us_per_record": None, "trackers": {}}
    out["feed_us_per_record"] = round(statistics.median(feed_cost(a.records) for _ in range(a.reps)), 2)
    for kind in trackers.TRACKERS:
        runs = [one_tracker(kind, a.records) for _ in range(a.reps)]
        out["trackers"][kind] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    print(f"feed: {out['feed_us_per_record']} us/record on the supervisor's thread (all three trackers)")
    for kind, f in out["trackers"].items():
        print(f"{kind:12s} open {f['open_s']:.2f} s, {f['ms_per_record']:.3f} ms/record, close {f['close_s']:.2f} s")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
