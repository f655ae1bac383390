"""The experiment trackers (clusterops.trackers): the figures a timeline gives, and the sink
writing TensorBoard, W&B (offline) and MLflow (sqlite) with their real libraries, read back
with each tracker's own reader (tests/support/trackerfiles.py), across a requeue."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops import trackers
from clusterops.errors import InputError
from clusterops.supervisor.timeline import Timeline, load
from tests.support.trackerfiles import tensorboard_scalars, wandb_runs

T0 = 1_800_000_000.0


def _records(job_dir: Path, steps):
    """Append (dt, event, fields) to the job's timeline; returns the records."""
    out = []
    for dt, event, fields, inc in steps:
        out.append(Timeline(job_dir, job_id="77", incarnation=inc).append(event, fields, t=T0 + dt))
    return out


# incarnation 0: a kill -9 (restart from the checkpoint of step 4), a rollback, then a requeue
FIRST = [
    (0, "launch", {"attempt": 1, "nodes": ["node1"], "resume_step": None}, 0),
    (2, "progress", {"step": 2, "loss": 2.0}, 0),
    (4, "checkpoint", {"step": 4}, 0),
    (5, "progress", {"step": 6, "loss": 1.5}, 0),
    (6, "step_exit", {"returncode": 137, "cause": "rank_killed", "blamed": ["node1"]}, 0),
    (7, "restart", {"reason": "rank killed"}, 0),
    (8, "launch", {"attempt": 2, "nodes": ["node1"], "resume_step": 4}, 0),
    (10, "progress", {"step": 8, "loss": 1.2}, 0),
    (11, "nan", {"signal": "loss", "value": "nan", "step": 9, "began": 9, "decision": "rollback"}, 0),
    (11.5, "progress", {"step": 9, "loss": "nan"}, 0),
    (12, "rollback", {"rollback": 1, "to_step": 4, "skip_batches": 5, "lr_factor": 1.0, "lost_steps": 5}, 0),
    (13, "launch", {"attempt": 3, "nodes": ["node1"], "resume_step": 4}, 0),
    (15, "progress", {"step": 7, "loss": 1.1}, 0),
    (16, "requeue", {"reason": "test"}, 0),
]
# incarnation 1 (a new supervisor process)
SECOND = [
    (40, "start", {}, 1),
    (41, "launch", {"attempt": 1, "nodes": ["node2"], "resume_step": 6}, 1),
    (44, "progress", {"step": 10, "loss": 0.9}, 1),
    (45, "done", {"reason": "finished"}, 1),
]


def test_figures_from_a_timeline(tmp_path):
    recs = _records(tmp_path, FIRST + SECOND)
    fig = trackers.Figures()
    items = [i for i in (fig.take(r) for r in recs) if i is not None]
    by = lambda key: [(i.step, i.scalars[key]) for i in items if key in i.scalars]  # noqa: E731
    assert by("clusterops/loss") == [(2, 2.0), (6, 1.5), (8, 1.2), (7, 1.1), (10, 0.9)]
    assert by("clusterops/loss_nonfinite") == [(9, 1.0)]
    # the kill: 6 -> 4 loses 2; the rollback's relaunch: 9 -> 4 loses 5; the requeue: 9 -> 6 loses 3
    assert by("clusterops/steps_lost") == [(4, 2.0), (4, 5.0), (6, 3.0)]
    assert by("clusterops/steps_lost_total")[-1] == (6, 10.0)
    # recovery: the kill at +6 to the progress at +10; the NaN marker at +11 starts nothing,
    # the rollback at +12 to +15; the requeue at +16 to +44
    assert by("clusterops/recovery_s") == [(8, 4.0), (7, 3.0), (10, 28.0)]
    markers = [(i.marker, i.step) for i in items if i.marker]
    assert markers == [("step_exit", 6), ("restart", 6), ("nan", 8), ("rollback", 9), ("requeue", 7), ("done", 10)]
    assert all("clusterops/goodput" in i.scalars for i in items if i.marker)
    assert 0 < [i for i in items if i.marker == "done"][0].scalars["clusterops/goodput"] < 1
    assert "ROLLBACK 1: to the checkpoint of step 4" in fig.markers[3]


def _sink(job_dir: Path, warnings: list, specs):
    return trackers.TrackerSink(specs, job_dir, job_name="tjob", job_id="77", warn=warnings.append)


def test_three_trackers_written_and_read_back_across_a_requeue(tmp_path):
    specs = trackers.parse([{"kind": "tensorboard"}, {"kind": "wandb", "project": "clusterops-test"},
                            {"kind": "mlflow"}])
    warnings: list = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    # incarnation 0: fed live, closed as for a requeue
    sink = _sink(tmp_path, warnings, specs)
    sink.start([])
    for r in _records(tmp_path, FIRST):
        sink.feed(r)
    assert sink.close("requeue", wait_s=120)
    state = json.loads((tmp_path / trackers.STATE_FILE).read_text())
    assert state["delivered_t"] == T0 + 16
    # a record written after the close (the requeue's warning): delivered by the next incarnation
    late = _records(tmp_path, [(17, "warning", {"what": "late"}, 0), (18, "supervisor_lost",
                                                                      {"rank": 0, "node": "node1"}, 0)])
    # incarnation 1: a new sink replays the timeline, then is fed live
    sink = _sink(tmp_path, warnings, specs)
    sink.start(load(tmp_path)[0])
    for r in _records(tmp_path, SECOND):
        sink.feed(r)
    assert sink.close("done", wait_s=120)
    assert warnings == []
    assert {s: signal.getsignal(s) for s in handlers} == handlers   # no tracker took the supervisor's signals
    assert len(late) == 2

    # TensorBoard: every figure once (the replay did not write incarnation 0 again)
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in tb["clusterops/loss"]] == [2, 6, 8, 7, 10]
    assert [v for _, v in tb["clusterops/loss"]] == pytest.approx([2.0, 1.5, 1.2, 1.1, 0.9])   # float32
    assert [s for s, _ in tb["clusterops/events/rollback"]] == [9]
    assert [s for s, _ in tb["clusterops/events/supervisor_lost"]] == [7]   # the late record, delivered once
    texts = [text for _, text in tb["clusterops/events#text"]]
    assert any(t.startswith("**rollback** (incarnation 0): ROLLBACK 1") for t in texts)
    assert any(t.startswith("**requeue**") for t in texts) and any(t.startswith("**done** (incarnation 1)")
                                                                       for t in texts)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2

    # W&B: one run id, two offline incarnations, the training step as the x-axis metric
    run_id = state["1:wandb"]["run_id"]
    runs = wandb_runs(tmp_path, run_id)
    assert [r["run"]["run_id"] for r in runs] == [run_id, run_id]
    assert runs[0]["run"]["project"] == "clusterops-test" and runs[0]["run"]["display_name"] == "tjob-77"
    rows = [row for r in runs for row in r["history"]]
    assert [(row["clusterops/step"], row["clusterops/loss"]) for row in rows if "clusterops/loss" in row] == \
        [(2, 2.0), (6, 1.5), (8, 1.2), (7, 1.1), (10, 0.9)]
    assert [row["clusterops/event"] for row in rows if "clusterops/event" in row] == [
        "step_exit", "restart", "nan", "rollback", "requeue", "supervisor_lost", "done"]

    # MLflow: one run across both incarnations, finished
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(state["2:mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tjob-77"
    assert client.get_experiment(run.info.experiment_id).name == "tjob"
    loss = sorted((m.timestamp, m.step, m.value) for m in client.get_metric_history(run.info.run_id, "clusterops/loss"))
    assert [(s, v) for _, s, v in loss] == [(2, 2.0), (6, 1.5), (8, 1.2), (7, 1.1), (10, 0.9)]
    lost = client.get_metric_history(run.info.run_id, "clusterops/steps_lost_total")
    assert max(m.value for m in lost) == 10.0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "clusterops/events/requeue")] == [7]
    assert list((tmp_path / "mlflow-artifacts").rglob("events.txt")), "artifacts beside the store, not in ./mlruns"
    local = Path(client.download_artifacts(run.info.run_id, "clusterops/events.txt", str(tmp_path / "dl")))
    lines = local.read_text().splitlines()
    assert len(lines) == 7 and "ROLLBACK" in lines[3] and lines[-1].startswith("step 10 [1] DONE")


def test_a_failing_tracker_is_said_once_and_the_others_go_on(tmp_path):
    (tmp_path / "not-a-dir").write_text("x")
    specs = trackers.parse([{"kind": "tensorboard", "dir": str(tmp_path / "not-a-dir" / "tb")},
                            {"kind": "mlflow"}])
    warnings: list = []
    sink = _sink(tmp_path, warnings, specs)
    sink.start([])
    for r in _records(tmp_path, FIRST):
        sink.feed(r)
    assert sink.close("give_up", wait_s=120)
    assert len(warnings) == 1 and warnings[0].startswith("tracker tensorboard: open failed: ")
    assert "nothing more is written to it" in warnings[0]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    state = json.loads((tmp_path / trackers.STATE_FILE).read_text())
    run = client.get_run(state["1:mlflow"]["run_id"])
    assert run.info.status == "FAILED"
    assert len(client.get_metric_history(run.info.run_id, "clusterops/loss")) == 4


@pytest.mark.parametrize("value,message", [
    ([{"kind": "tensorbord"}], "spec: supervise.trackers[0].kind: must be one of tensorboard, wandb, mlflow, "
                               "got 'tensorbord' (did you mean 'tensorboard'?)"),
    ([{"kind": "wandb", "mode": "cloud"}], "spec: supervise.trackers[0].mode: must be one of offline, online"),
    ([{"kind": "mlflow", "dir": "x"}], "spec: supervise.trackers[0].dir: unknown key"),
    ([{"kind": "tensorboard"}, "wandb"], "spec: supervise.trackers[1]: must be a mapping with kind:"),
    ({"kind": "wandb"}, "spec: supervise.trackers: must be a list of mappings"),
    ("[{", "--trackers: not valid JSON"),
])
def test_bad_tracker_settings_name_the_key(value, message):
    with pytest.raises(InputError) as e:
        trackers.parse(value)
    assert str(e.value).startswith(message), str(e.value)


def test_a_bad_tracker_in_a_job_spec_is_exit_2_with_file_and_line(tmp_path):
    (tmp_path / "t.py").write_text("pass\n")
    (tmp_path / "job.yaml").write_text("name: t\nnodes: 1\nlauncher: srun\nscript: t.py\nsupervise:\n"
                                       "  trackers:\n    - {kind: wandb, project: p, mode: cloud}\n")
    r = subprocess.run([sys.executable, "-m", "clusterops", "launch", "render", str(tmp_path / "job.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert "job.yaml:7: supervise.trackers.0.mode: must be one of offline, online" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_importing_clusterops_and_the_sink_loads_no_tracker_library():
    code = ("import sys, clusterops.trackers, clusterops.cli, clusterops.supervisor.run; "
            "print(sorted(m for m in ('tensorboard', 'wandb', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_trackers_flag_reaches_the_run_config(tmp_path, monkeypatch):
    from clusterops.supervisor.config import run_config

    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    cfg = run_config({}, ["--", "true"], {"job_dir": str(tmp_path / "job"), "nodes": 2,
                                          "trackers": '[{"kind": "wandb", "project": "p"}, {"kind": "mlflow"}]'})
    assert [(t.kind, dict(t.settings)) for t in cfg.trackers] == [("wandb", {"project": "p"}), ("mlflow", {})]
    assert cfg.trackers[1].resolved(cfg.job_dir, cfg.job_name, cfg.job_id)["tracking_uri"] == \
        f"sqlite:///{tmp_path / 'job' / 'mlflow.db'}"
    with pytest.raises(InputError, match=r"supervise.trackers\[0\].mode: must be one of offline, online"):
        run_config({}, ["--", "true"], {"job_dir": str(tmp_path / "job"), "nodes": 2,
                                        "trackers": '[{"kind": "wandb", "mode": "x"}]'})


def test_a_tracker_not_installed_says_which_extra_and_the_others_go_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError, as when absent
    warnings: list = []
    sink = _sink(tmp_path, warnings, trackers.parse([{"kind": "wandb"}, {"kind": "tensorboard"}]))
    sink.start([])
    for r in _records(tmp_path, FIRST):
        sink.feed(r)
    assert sink.close("requeue", wait_s=60)
    assert len(warnings) == 1 and warnings[0].startswith("tracker wandb: open failed: ModuleNotFoundError")
    assert "pip install 'clusterops[wandb]'" in warnings[0]
    assert len(tensorboard_scalars(tmp_path / "tensorboard")["clusterops/loss"]) == 4
