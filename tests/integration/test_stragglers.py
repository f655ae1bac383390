"""A straggler inside a running job, on the real dev cluster, slowed for real.

examples/train.py runs on 2 nodes (+1 spare) under `clusterops launch submit` with
`supervise: {replace_stragglers: true}`. The test slows ONE rank for real: a duty-cycled
SIGSTOP/SIGCONT loop on its process (stopped 0.3 s of every 0.5 s), so that rank's own
work per step takes ~2.5x longer while the other rank waits for it in the all-reduce.
The supervisor must name that rank's node from the ranks' busy time (step time is the
same on both ranks: the job is synchronous), stop the ranks at a checkpoint, relaunch
on the spare without the slow node, resume from exactly the step where they stopped,
finish, and end with weights bitwise equal to an uninterrupted run. Without a spare the
straggler is recorded only and the job runs on, never stopped for it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from support import faultkit as fk
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 150
CKPT_EVERY = 50


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of an uninterrupted 2-rank run (no Slurm, no supervisor, no slowdown)."""
    ref_dir = tmp_path_factory.mktemp("ref")
    out = ref_dir / "final.pt"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0",
                     "--out", str(out)], workdir=ref_dir)
    return out


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


class DutyCycle:
    """Stop a process for ``stop_s`` of every ``period_s`` (SIGSTOP/SIGCONT) until told to
    end or the process is gone; always leaves it continued."""

    def __init__(self, pids, stop_s=0.3, period_s=0.5):
        self.pids, self.stop_s, self.period_s = list(pids), stop_s, period_s
        self.cycles = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _signal(self, sig) -> bool:
        alive = False
        for pid in self.pids:
            try:
                os.kill(pid, sig)
                alive = True
            except ProcessLookupError:
                pass
        return alive

    def _run(self):
        try:
            while not self.done.is_set():
                if not self._signal(signal.SIGSTOP):
                    return
                self.cycles += 1
                time.sleep(self.stop_s)
                self._signal(signal.SIGCONT)
                self.done.wait(self.period_s - self.stop_s)
        finally:
            self._signal(signal.SIGCONT)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(timeout=5)


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.mark.timeout(400)
def test_slowed_rank_node_is_named_and_replaced_at_a_checkpoint_with_no_step_lost(cluster, slurm, reference,
                                                                                  tmp_path):
    job = fk.TrainJob(root=tmp_path / "strag", name="strag", nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.1,
                      supervise={"spare_nodes": 1, "replace_stragglers": True, "drain_bad_nodes": True,
                                 "straggler_window": 4, "straggler_warmup_steps": 10})
    job.submit()
    job.wait_step(15)
    with DutyCycle(job.rank_pids(1)) as slow:
        assert slow.pids
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not events(job, "straggler") and slow.thread.is_alive():
            time.sleep(0.5)
        # Keep it slow until the stop has been asked for (the rank exits, the loop ends).
        while time.monotonic() < deadline and slow.thread.is_alive() and not events(job, "stopped"):
            time.sleep(0.5)
    info = job.wait_end(slurm, timeout_s=240)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}"
    assert slow.cycles > 5, story

    # Found: the slowed rank's node, from busy time, and only that node.
    found = events(job, "straggler")
    assert [(r["node"], r["action"], r["measure"]) for r in found] == [("node2", "replace", "busy")], story
    assert found[0]["ratio"] >= 1.5 and found[0]["ranks"] == [1] and found[0]["spare"] == "node3", story

    # Replaced at a planned stop: the ranks saved the step they had reached ...
    stopped = events(job, "stopped")
    assert len(stopped) == 1 and stopped[0]["reason"] == "straggler", story
    stop_step = stopped[0]["ckpt_step"]
    t_stop = stopped[0]["t"]
    before = [r["max_step"] for r in events(job, "progress") if r["t"] <= t_stop]
    assert stop_step is not None and stop_step >= max(before), story
    # ... and the relaunch, without node2, resumes exactly there: 0 steps lost.
    launches = events(job, "launch")
    assert [l["nodes"] for l in launches] == [["node1", "node2"], ["node1", "node3"]], story
    assert launches[1]["resume_step"] == stop_step, story
    resumes = [r for r in events(job, "resume") if r["t"] > t_stop]
    assert resumes and resumes[0]["step"] == stop_step, story
    assert not events(job, "requeue") and info.restart_count == 0, story

    # Kept out: remembered for later incarnations and drained as a straggler.
    assert events(job, "node_bad")[0]["node"] == "node2", story
    state = json.loads((job.job_dir / "supervisor-state.json").read_text())
    assert "node2" in state["bad_nodes"], state
    node2 = slurm.node("node2")
    assert node2.drained and (node2.reason or "").startswith("clusterops:straggler: "), node2.reason

    # Recorded in the job's metrics.
    prom = (job.job_dir / "clusterops_job.prom").read_text()
    assert 'clusterops_job_stragglers{job="%s"} 1.0' % job.job_id in prom, prom
    assert 'clusterops_job_stragglers_replaced{job="%s"} 1.0' % job.job_id in prom, prom
    assert 'clusterops_job_node_slowness_ratio{job="%s",node="node2"}' % job.job_id in prom, prom

    # The same weights as a run that was never slowed or stopped.
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"
    assert fk.damaged_checkpoints(job.ckpt_dir) == []


@pytest.mark.timeout(300)
def test_without_a_spare_the_straggler_is_recorded_and_the_job_runs_on(cluster, slurm, reference, tmp_path):
    job = fk.TrainJob(root=tmp_path / "strag-rec", name="strag-rec", nodes=2, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.1,
                      supervise={"replace_stragglers": True, "straggler_window": 4, "straggler_warmup_steps": 10})
    job.submit()
    job.wait_step(15)
    with DutyCycle(job.rank_pids(0)) as slow:      # rank 0 this time: node1, the batch host
        assert slow.pids
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not events(job, "straggler") and slow.thread.is_alive():
            time.sleep(0.5)
    info = job.wait_end(slurm, timeout_s=240)
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state} {info.exit_code}\n{story}"
    found = events(job, "straggler")
    assert [(r["node"], r["action"], r["why"]) for r in found] == [("node1", "record", "no spare node")], story
    # Never stopped for it: one launch, no stop, no node dropped, no drain.
    assert len(events(job, "launch")) == 1 and not events(job, "stop_requested"), story
    assert not events(job, "node_bad") and not slurm.node("node1").drained, story
    # Once the slowdown ended the figures came back: the last evaluation finds no node slow.
    last = [r["slowest"] for r in events(job, "progress") if r.get("slowest")][-1]
    assert last[1] < 1.5, (last, story)
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"
