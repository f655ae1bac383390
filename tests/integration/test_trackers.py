"""The experiment trackers on the real dev cluster: a supervised run of examples/train.py
(2 nodes, gloo) with all three trackers on, through a kill -9 of a rank (restart), a poisoned
data window (the stability guard rolls back) and the time limit's lead signal (stop, requeue,
a second incarnation that finishes). The records are then read back with each tracker's own
reader: TensorBoard's EventAccumulator, W&B's offline run files (wandb's protobuf) and
MLflow's MlflowClient; one run per tracker across both incarnations."""

from __future__ import annotations

import json
import signal

import pytest

from support import faultkit as fk
from support.trackerfiles import tensorboard_scalars, wandb_runs
from support.wait import wait_for
from clusterops import trackers
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

GUARD = {"on_spike": "rollback", "on_nan": "rollback", "warmup_steps": 20, "min_samples": 4,
         "rollback_steps": 10, "skip_batches": 30, "lr_factor": 0.5, "max_rollbacks": 2}


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


def test_kill_rollback_requeue_read_back_with_each_trackers_reader(cluster, slurm, tmp_path):
    j = fk.TrainJob(root=tmp_path / "trk", name="trk", nodes=2, steps=90, ckpt_every=10, step_sleep=0.1,
                    train_args=["--poison-batches", "50:60"],
                    supervise={"stability": GUARD, "trackers": [
                        {"kind": "tensorboard"}, {"kind": "wandb", "project": "clusterops-it"}, {"kind": "mlflow"}]})
    j.submit()
    story = lambda: tl.format_text(j.timeline()) + j.failed_step_logs()  # noqa: E731
    # 1. kill -9 a rank: the supervisor restarts the step from the checkpoint of step 10
    j.wait_step(14, timeout_s=180)
    j.signal_rank(1, signal.SIGKILL)
    # 2. the poisoned window: a rollback, and the relaunch after it trains again
    def trains_after_rollback():
        recs = j.timeline()
        at = next((i for i, r in enumerate(recs) if r["event"] == "rollback"), None)
        return at is not None and any(r["event"] == "progress" for r in recs[at:])
    wait_for(trains_after_rollback, 180, "training after the rollback", interval_s=0.5, detail=story)
    # 3. the time limit's lead signal: stop with a checkpoint, requeue, finish in incarnation 1
    slurm.signal(j.job_id, "USR1", batch=True)
    info = j.wait_end(slurm, timeout_s=240)
    text = story()
    assert info.state == "COMPLETED" and info.exit_code == 0 and info.restart_count == 1, text
    kinds = [r["event"] for r in j.timeline()]
    assert {"restart", "rollback", "requeue", "done"} <= set(kinds), text
    warnings = [r["what"] for r in j.timeline() if r["event"] == "warning" and "tracker" in r.get("what", "")]
    assert warnings == [], warnings

    state = json.loads((j.job_dir / trackers.STATE_FILE).read_text())
    losses = [(r["step"], r["loss"]) for r in j.timeline() if r["event"] == "progress"
              and isinstance(r.get("loss"), (int, float))]
    assert losses, text

    # TensorBoard: one directory, an event file per incarnation, the guard's loss at its steps
    tb = tensorboard_scalars(j.job_dir / "tensorboard")
    assert len(list((j.job_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert [s for s, _ in tb["clusterops/loss"]] == [s for s, _ in losses]
    assert [v for _, v in tb["clusterops/loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)
    for kind in ("step_exit", "restart", "rollback", "requeue", "done"):
        assert tb[f"clusterops/events/{kind}"], kind
    assert max(v for _, v in tb["clusterops/steps_lost_total"]) > 0
    assert all(v > 0 for _, v in tb["clusterops/recovery_s"])
    assert 0 < tb["clusterops/goodput"][-1][1] < 1
    texts = [t for _, t in tb["clusterops/events#text"]]
    assert any(t.startswith("**rollback** (incarnation 0)") for t in texts)
    assert any(t.startswith("**done** (incarnation 1)") for t in texts)

    # W&B offline: one run id, resumed by the second incarnation
    run_id = state["1:wandb"]["run_id"]
    runs = wandb_runs(j.job_dir, run_id)
    assert len(runs) == 2 and {r["run"]["project"] for r in runs} == {"clusterops-it"}
    rows = [row for r in runs for row in r["history"]]
    events = [row["clusterops/event"] for row in rows if "clusterops/event" in row]
    assert {"restart", "rollback", "requeue", "done"} <= set(events) and events[-1] == "done", events
    assert [row["clusterops/loss"] for row in rows if "clusterops/loss" in row] == \
        pytest.approx([v for _, v in losses])

    # MLflow: one run across both incarnations, finished, with the job's markers
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{j.job_dir / 'mlflow.db'}")
    run = client.get_run(state["2:mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == f"trk-{j.job_id}"
    assert len(client.get_metric_history(run.info.run_id, "clusterops/loss")) == len(losses)
    assert client.get_metric_history(run.info.run_id, "clusterops/events/requeue")
    assert client.get_metric_history(run.info.run_id, "clusterops/recovery_s")
    local = client.download_artifacts(run.info.run_id, "clusterops/events.txt", str(tmp_path / "dl"))
    lines = open(local).read().splitlines()
    assert any("ROLLBACK" in line for line in lines) and "DONE" in lines[-1], lines
    assert not (j.root / "mlruns").exists()   # artifacts beside the store, not in the job's workdir
