"""The stability guard on the real dev cluster: examples/train.py (4 ranks, gloo) with a data
window poisoned on purpose (``--poison-batches``: the loss spikes, then goes NaN).

- ``rollback``: the supervisor kills the step, sets the checkpoints after the rollback point
  aside, relaunches from it with the hint (skip the window, lower the LR), and the job
  finishes with final weights bitwise equal to an uninterrupted run that skips the same
  batches and lowers the LR at the same step from the start.
- ``record``: the same run shows the anomaly in the timeline and changes nothing (the final
  weights are those of the same run without the guard: diverged).
- a poison that comes back after every rollback: the give-up code (9), a ``job_diverged``
  webhook, and the checkpoint before the anomaly intact.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from support import faultkit as fk
from clusterops import checkpoint as ck
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 120
CKPT_EVERY = 10
POISON = "70:80"          # data batches 70-74 scaled (spike), 75-79 NaN
GUARD = {"on_spike": "rollback", "on_nan": "rollback", "warmup_steps": 20, "min_samples": 4,
         "rollback_steps": 10, "skip_batches": 30, "lr_factor": 0.5, "max_rollbacks": 2}


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


def job(tmp_path, name, guard, poison=POISON, **kw):
    return fk.TrainJob(root=tmp_path / name, name=name, steps=STEPS, ckpt_every=CKPT_EVERY, step_sleep=0.1,
                       supervise={"stability": guard, **kw.pop("supervise", {})},
                       train_args=["--poison-batches", poison], **kw)


def reference(tmp_path, at=None, skip=30):
    return fk.rollback_reference(4, tmp_path / "reference", steps=STEPS, poison=POISON, at=at, skip=skip,
                                 args=["--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0"])


def events(j, kind):
    return [r for r in j.timeline() if r["event"] == kind]


def test_rollback_skips_the_poisoned_window_and_ends_bitwise_equal(cluster, slurm, tmp_path):
    j = job(tmp_path, "stab-rollback", GUARD)
    j.submit()
    info = j.wait_end(slurm)
    story = tl.format_text(j.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}"
    found = events(j, "nan") + events(j, "loss_spike")
    rb = events(j, "rollback")
    assert found and len(rb) == 1, story
    to = rb[0]["to_step"]
    assert to % CKPT_EVERY == 0 and to <= found[0]["began"] - GUARD["rollback_steps"], story
    assert [r["cause"] for r in events(j, "step_exit")][0] == "rolled_back", story
    # The discarded timeline's checkpoints are out of the root, none damaged in it.
    aside = events(j, "checkpoint_set_aside")
    assert aside and aside[0]["after_step"] == to, story
    assert fk.damaged_checkpoints(j.ckpt_dir) == []
    skip = rb[0]["skip_batches"]       # 30, or more so it passes the NaN seen (by 20 = 30 - 10)
    seen = [f["step"] for f in found if f["began"] == rb[0]["anomaly_step"]]
    assert seen and skip == max(30, seen[0] + 20 - to), story
    assert "rollback-hint step=%d skip=%d lr_factor=0.5" % (to, skip) in (j.latest_attempt() / "step.log").read_text()
    ref = reference(tmp_path, at=to, skip=skip)
    assert not fk.nan_weights(ref)
    assert fk.same_weights(j.out, ref), f"final weights differ from the run that skips the same batches\n{story}"


def test_record_shows_the_anomaly_and_changes_nothing(cluster, slurm, tmp_path):
    j = job(tmp_path, "stab-record", dict(GUARD, on_spike="record", on_nan="record"))
    j.submit()
    info = j.wait_end(slurm)
    story = tl.format_text(j.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, story
    nan = events(j, "nan")
    assert nan and nan[0]["decision"] == "record" and nan[0]["value"] == "nan", story
    assert not events(j, "rollback") and len(events(j, "launch")) == 1, story
    ref = reference(tmp_path)
    assert fk.nan_weights(ref) and fk.same_weights(j.out, ref), story


class _Hook(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Hook.got.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_a_spike_that_keeps_coming_back_gives_up_with_the_last_good_checkpoint_intact(cluster, slurm, tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.got = []
    try:
        # Poisoned from batch 70 on, far past any skip: every rollback meets it again.
        j = job(tmp_path, "stab-giveup", GUARD, poison="70:100000",
                spec_extra={"notify": [f"http://127.0.0.1:{server.server_port}/hook"]})
        j.submit()
        info = j.wait_end(slurm)
    finally:
        server.shutdown()
    story = tl.format_text(j.timeline())
    assert info.exit_code == sv.EXIT_ROLLBACK_BUDGET, f"{info.state} {info.exit_code}\n{story}"
    assert len(events(j, "rollback")) == GUARD["max_rollbacks"], story
    give = events(j, "give_up")
    assert give and give[0]["code"] == sv.EXIT_ROLLBACK_BUDGET, story
    assert any(h.get("event") == "job_diverged" for h in _Hook.got), _Hook.got
    assert any(h.get("event") == "job_rolled_back" for h in _Hook.got), _Hook.got
    # The latest checkpoint in the root verifies (hashes too) and is from before the first
    # poisoned batch (data batch 70 is step 70 before any skip): a state that never saw NaN.
    latest = ck.find_latest_good(j.ckpt_dir, deep=True).latest
    assert latest is not None and latest.step < 70, story
    assert fk.damaged_checkpoints(j.ckpt_dir) == []


def test_rollback_of_a_script_without_the_sdk_through_resume_args(cluster, slurm, tmp_path):
    """examples/plain_train.py imports nothing from clusterops: the loss comes from its output
    (`loss_regex`), the rollback's skip and LR factor through `resume_args`."""
    plain = fk.REPO / "examples" / "plain_train.py"
    poison = "45:55"
    j = fk.TrainJob(root=tmp_path / "plain", name="stab-plain", nodes=2, steps=80, ckpt_every=10, step_sleep=0.25,
                    script=plain, supervise={
                        "progress": {"regex": r"step[= ](\d+)", "loss_regex": r"loss=(\S+)"},
                        "checkpoint_glob": "ckpt_*.pt",
                        "resume_args": ["--resume", "{ckpt}", "--skip-batches", "{skip_batches}",
                                        "--lr-factor", "{lr_factor}"],
                        "stability": dict(GUARD, warmup_steps=10)})
    j.train_args = ["--ckpt-dir", str(j.ckpt_dir), "--poison-batches", poison]
    j.submit()
    info = j.wait_end(slurm)
    story = tl.format_text(j.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}"
    rb = events(j, "rollback")
    assert events(j, "nan") and len(rb) == 1, story
    to = rb[0]["to_step"]
    assert not list(j.ckpt_dir.glob(f"rolled-back-1/ckpt_{to:07d}.pt")), story
    commands = [p.read_text().splitlines()[0] for p in sorted(j.job_dir.glob("attempt-*/command.txt"))]
    skip = rb[0]["skip_batches"]
    assert any(f"--skip-batches {skip} --lr-factor 0.5" in c and f"ckpt_{to:07d}.pt" in c for c in commands), commands
    d = tmp_path / "ref"
    ref = fk.rollback_reference(2, d, steps=80, poison=poison, at=to, skip=skip, script=plain,
                                args=["--ckpt-every", "10", "--ckpt-dir", str(d / "ck")])
    assert not fk.nan_weights(ref)
    assert fk.same_weights(j.out, ref), f"final weights differ from the run that skips the same batches\n{story}"
