"""Experiment trackers: the supervisor's view of a job written into TensorBoard, Weights &
Biases and MLflow (``supervise: {trackers: [...]}``; docs/trackers.md).

A sink of the supervisor's timeline, like the webhooks of :mod:`clusterops.notify`: every
record the supervisor appends is handed to :meth:`TrackerSink.feed`, which returns at once.
:class:`Figures` (pure) turns records into what a tracker is told, at the training step as
x-axis:

- scalars: ``clusterops/loss`` (the loss the stability guard sees), ``clusterops/goodput``,
  ``clusterops/restarts``, ``clusterops/steps_lost`` (by one relaunch or rollback) and
  ``clusterops/steps_lost_total``, ``clusterops/recovery_s`` (a fault to the first progress
  after it; a fault healed in-process: to its first step);
- markers: one per timeline event of :data:`MARKER_KINDS` (restart, requeue, rollback,
  in-process recovery, straggler, node dropped, ...), as the scalar
  ``clusterops/events/<kind>`` = 1 and a line of text (the timeline's own description).

One worker thread writes to the trackers, each through its library (imported there, never
at ``import clusterops``). A tracker that fails (not installed, disk full, no network) is
said once in the timeline (a ``warning``) and written to no more; the others go on, and
supervision never waits for any of them beyond :meth:`TrackerSink.close`'s bound.

Across requeues one tracker run goes on: the W&B and MLflow run ids are kept in
``<job_dir>/trackers.json`` and resumed (W&B ``id=``, ``resume="allow"``), TensorBoard appends a
new event file to the same directory. The file also keeps the time of the last record
delivered, so that a new incarnation first replays the timeline (for the running figures)
and delivers what the last one could not (records written after its close, or by the ranks
while no supervisor ran).
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from clusterops.errors import InputError
from clusterops.supervisor.timeline import Cause, EventKind as E, describe, goodput_report

STATE_FILE = "trackers.json"
#: Records waiting for the worker beyond this are dropped (said once): a tracker that stalls
#: must not grow the supervisor's memory without bound.
QUEUE_MAX = 100_000
PREFIX = "clusterops/"

#: Timeline events that become markers. ``node_down``, ``node_bad``, ``node_drained`` and
#: ``shrink`` are the ways a node is dropped; ``inproc_first_step`` is an in-process recovery.
MARKER_KINDS = frozenset({
    E.RESTART, E.REQUEUE, E.ROLLBACK, E.INPROC_FIRST_STEP, E.INPROC_FALLBACK, E.STRAGGLER,
    E.NODE_DOWN, E.NODE_BAD, E.NODE_DRAINED, E.SHRINK, E.SPARE_USED, E.STEP_EXIT, E.HEARTBEAT_LOST,
    E.NAN, E.LOSS_SPIKE, E.SDC_SUSPECT, E.SUPERVISOR_LOST, E.TAKEOVER, E.STOP_REQUESTED, E.DONE, E.GIVE_UP,
})
#: Events from which recovery time is counted (to the next progress that advances).
FAULT_KINDS = frozenset({E.STEP_EXIT, E.HEARTBEAT_LOST, E.NODE_DOWN, E.ROLLBACK, E.RESTART, E.REQUEUE,
                         E.SUPERVISOR_LOST, E.INPROC_FAULT, E.STOP_REQUESTED})


@dataclass(frozen=True)
class TrackerSpec:
    """One entry of ``supervise: trackers:``, validated (``schema.TRACKER_FIELDS``), defaults
    not yet filled (they depend on the job directory: :meth:`resolved`)."""

    kind: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    def resolved(self, job_dir: Path, job_name: str, job_id: Optional[str]) -> Dict[str, Any]:
        s = dict(self.settings)
        run = f"{job_name}-{job_id}" if job_id else job_name
        if self.kind == "tensorboard":
            s.setdefault("dir", str(job_dir / "tensorboard"))
        elif self.kind == "wandb":
            s.setdefault("project", job_name)
            s.setdefault("name", run)
            s.setdefault("mode", "offline")
            s.setdefault("dir", str(job_dir))
        elif self.kind == "mlflow":
            s.setdefault("tracking_uri", f"sqlite:///{job_dir / 'mlflow.db'}")
            db = s["tracking_uri"][len("sqlite:///"):] if s["tracking_uri"].startswith("sqlite:///") else None
            if db and "artifact_location" not in s:
                # MLflow's own default is ./mlruns in the current directory (the job's workdir)
                s["artifact_location"] = str(Path(db).parent / "mlflow-artifacts")
            s.setdefault("experiment", job_name)
            s.setdefault("run_name", run)
        return s


def parse(value: Any, where: str = "supervise.trackers") -> List[TrackerSpec]:
    """``supervise: trackers:`` (a list; a flag gives it as JSON text) -> specs; InputError
    naming the key for anything wrong."""
    from clusterops import schema

    if value is None or value == []:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InputError(f"--trackers: not valid JSON ({e})") from None
    kinds = dict(schema.KINDS, path=lambda c, v, f, path: schema.KINDS["str"](c, v, f, path))
    checker = schema.Checker(kinds, lambda path, message: InputError(
        f"spec: {where}{''.join(f'[{p}]' if isinstance(p, int) else '.' + str(p) for p in path[2:])}: {message}"))
    items = checker.check(value, schema.supervise_field("trackers"), ("supervise", "trackers"))
    return [TrackerSpec(item["kind"], {k: v for k, v in item.items() if k != "kind" and v is not None})
            for item in items]


# ------------------------------------------------------------------------------ figures
@dataclass
class Item:
    """What the trackers are told about one record: at ``step``, these ``scalars``, and a
    marker (its event kind and a line of text) or none."""

    t: float
    step: int
    scalars: Dict[str, float] = field(default_factory=dict)
    marker: Optional[str] = None
    text: str = ""
    incarnation: int = 0


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class Figures:
    """Timeline records in, tracker items out (pure: no clock, no files). Keeps the whole
    timeline it has seen, for goodput, which is worked out again at each marker."""

    def __init__(self) -> None:
        self.records: List[dict] = []
        self.step = 0
        self.hwm: Optional[int] = None        # the highest step reached
        self.steps_lost_total = 0
        self.fault_at: Optional[float] = None
        self.markers: List[str] = []          # every marker's text line (all incarnations)

    def take(self, rec: Mapping) -> Optional[Item]:
        self.records.append(dict(rec))
        e, t = rec.get("event"), float(rec.get("t") or 0.0)
        item = Item(t, self.step, incarnation=int(rec.get("incarnation") or 0))
        if e == E.PROGRESS:
            step = _number(rec.get("step"))
            if step is not None:
                self.step = item.step = int(step)
                self.hwm = self.step if self.hwm is None else max(self.hwm, self.step)
                if self.fault_at is not None:
                    item.scalars["recovery_s"] = round(t - self.fault_at, 3)
                    self.fault_at = None
            if "loss" in rec:
                loss = _number(rec.get("loss"))
                item.scalars["loss" if loss is not None else "loss_nonfinite"] = loss if loss is not None else 1.0
        elif e == E.LAUNCH:
            resume = _number(rec.get("resume_step"))
            start = int(resume) if resume is not None else 0
            if self.hwm is not None and self.hwm > start:
                lost = self.hwm - start
                self.steps_lost_total += lost
                item.scalars.update(steps_lost=lost, steps_lost_total=self.steps_lost_total)
            self.step = item.step = start
        elif e == E.INPROC_FIRST_STEP:
            took = _number(rec.get("fault_to_step_s"))
            if took is None and self.fault_at is not None:
                took = t - self.fault_at
            if took is not None:
                item.scalars["recovery_s"] = round(took, 3)
            self.fault_at = None
        if e in FAULT_KINDS and not (e == E.STEP_EXIT and rec.get("cause") == Cause.FINISHED):
            if self.fault_at is None:
                self.fault_at = t
        if e in MARKER_KINDS and not (e == E.STEP_EXIT and rec.get("cause") == Cause.FINISHED):
            item.marker = str(e)
            item.text = describe(rec)
            self.markers.append(f"step {item.step} [{item.incarnation}] {item.text}")
            rep = goodput_report(self.records)
            if rep is not None:
                item.scalars.update(goodput=rep["goodput"], restarts=float(rep["restarts"]))
        if not item.scalars and item.marker is None:
            return None
        item.scalars = {PREFIX + k: float(v) for k, v in item.scalars.items()}
        return item


# ------------------------------------------------------------------------------ trackers
class Tracker:
    """One tracker: opened once (in the worker thread), written item by item."""

    kind = ""

    def __init__(self, settings: Mapping[str, Any], job_id: Optional[str]):
        self.settings = dict(settings)
        self.job_id = job_id

    def open(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """Start or resume; returns what must be kept for the next incarnation."""
        return {}

    def write(self, item: Item) -> None:
        raise NotImplementedError

    def flush(self, markers: Sequence[str]) -> None:
        pass

    def close(self, outcome: Optional[str]) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Event files written with TensorBoard's own writer: scalars as ``simple_value``, markers
    as a text summary ``clusterops/events`` and the scalar ``clusterops/events/<kind>``."""

    kind = "tensorboard"

    def open(self, state):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir = Path(self.settings["dir"])
        logdir.mkdir(parents=True, exist_ok=True)
        # Each incarnation its own file (the name carries the time, host and pid): the
        # readers merge the files of a directory by step.
        self.writer = EventFileWriter(str(logdir), flush_secs=10)
        return {}

    def write(self, item):
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in item.scalars.items()]
        if item.marker:
            values.append(summary_pb2.Summary.Value(tag=f"{PREFIX}events/{item.marker}", simple_value=1.0))
        if values:
            self.writer.add_event(event_pb2.Event(wall_time=item.t, step=item.step,
                                                  summary=summary_pb2.Summary(value=values)))
        if item.marker:
            from tensorboard.plugins.text.summary_v2 import text_pb

            self.writer.add_event(event_pb2.Event(
                wall_time=item.t, step=item.step,
                summary=text_pb(f"{PREFIX}events", f"**{item.marker}** (incarnation {item.incarnation}): {item.text}")))

    def flush(self, markers):
        self.writer.flush()

    def close(self, outcome):
        self.writer.close()


class WandbTracker(Tracker):
    """One W&B run per job: ``id=`` kept in the job directory, ``resume="allow"``. W&B's own
    step counts the calls; the training step is the metric ``clusterops/step``, the x-axis
    of every ``clusterops/*`` metric (W&B drops a step lower than its last, and a rollback
    goes back)."""

    kind = "wandb"

    def open(self, state):
        import wandb

        import secrets

        run_id = state.get("run_id") or secrets.token_hex(6)   # W&B ids: letters and digits
        s = self.settings
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        self.run = wandb.init(project=s["project"], entity=s.get("entity"), name=s.get("name"),
                              group=s.get("group"), mode=s["mode"], dir=s["dir"], id=run_id, resume="allow",
                              config={"slurm_job_id": self.job_id}, settings=settings)
        self.run.define_metric(f"{PREFIX}step")
        self.run.define_metric(f"{PREFIX}*", step_metric=f"{PREFIX}step")
        return {"run_id": run_id}

    def write(self, item):
        row: Dict[str, Any] = dict(item.scalars)
        row[f"{PREFIX}step"] = item.step
        if item.marker:
            row[f"{PREFIX}events/{item.marker}"] = 1.0
            row[f"{PREFIX}event"] = item.marker
            row[f"{PREFIX}event_text"] = f"(incarnation {item.incarnation}) {item.text}"
        self.run.log(row)

    def close(self, outcome):
        self.run.finish(exit_code=0 if outcome in (None, "done", "requeue", "stopped") else 1)


class MlflowTracker(Tracker):
    """One MLflow run per job (``MlflowClient``; id kept in the job directory): scalars as
    metrics at the training step, markers as ``clusterops/events/<kind>`` metrics and the
    artifact ``clusterops/events.txt`` (every marker of the job, rewritten at each flush)."""

    kind = "mlflow"

    def open(self, state):
        from mlflow.tracking import MlflowClient

        s = self.settings
        self.client = MlflowClient(tracking_uri=s["tracking_uri"])
        run_id = state.get("run_id")
        if run_id:
            run = self.client.get_run(run_id)
            if run.info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(s["experiment"])
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                s["experiment"], artifact_location=s.get("artifact_location"))
            run_id = self.client.create_run(exp_id, run_name=s["run_name"],
                                            tags={"clusterops.slurm_job_id": str(self.job_id or "")}).info.run_id
        self.run_id = run_id
        self.pending: list = []
        self.markers_written = -1
        return {"run_id": run_id}

    def write(self, item):
        from mlflow.entities import Metric

        ms = int(item.t * 1000)
        self.pending += [Metric(k, v, ms, item.step) for k, v in item.scalars.items()]
        if item.marker:
            self.pending.append(Metric(f"{PREFIX}events/{item.marker}", 1.0, ms, item.step))
        if len(self.pending) >= 200:
            self._send()

    def _send(self):
        while self.pending:
            batch, self.pending = self.pending[:1000], self.pending[1000:]
            self.client.log_batch(self.run_id, metrics=batch)

    def flush(self, markers):
        self._send()
        if markers and len(markers) != self.markers_written:
            self.client.log_text(self.run_id, "\n".join(markers) + "\n", f"{PREFIX}events.txt")
            self.markers_written = len(markers)

    def close(self, outcome):
        if outcome == "done":
            self.client.set_terminated(self.run_id, "FINISHED")
        elif outcome == "give_up":
            self.client.set_terminated(self.run_id, "FAILED")
        # requeued or stopped: the run goes on in the next incarnation (left RUNNING)


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
#: The extra that installs each tracker's library.
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


# ------------------------------------------------------------------------------ the sink
def load_state(job_dir: Path) -> Dict[str, Any]:
    try:
        doc = json.loads((Path(job_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class TrackerSink:
    """Hands timeline records to the configured trackers on a worker thread.

    ``start(history)`` once (the timeline so far), ``feed(record)`` for each new record,
    ``close(outcome, wait_s)`` once. ``warn(text)`` is called (from the worker thread) once
    per tracker that fails, and once if records had to be dropped; nothing here raises."""

    def __init__(self, specs: Sequence[TrackerSpec], job_dir: Path, *, job_name: str, job_id: Optional[str],
                 warn: Callable[[str], None]):
        self.job_dir = Path(job_dir)
        self.job_id = job_id
        self.warn = warn
        self.trackers: List[Tracker] = [TRACKERS[s.kind](s.resolved(self.job_dir, job_name, job_id), job_id)
                                        for s in specs]
        self.keys = [f"{i}:{t.kind}" for i, t in enumerate(self.trackers)]
        self.failed: Dict[int, str] = {}
        self.figures = Figures()
        self.q: "queue.Queue" = queue.Queue(maxsize=QUEUE_MAX)
        self.thread: Optional[threading.Thread] = None
        self.dropped = 0
        self.delivered_t: Optional[float] = None
        self.closed = threading.Event()
        self.state_warned = False

    # -- the supervisor's side (never blocks, never raises) -------------------------------
    def start(self, history: Sequence[Mapping]) -> None:
        if not self.trackers:
            return
        self.thread = threading.Thread(target=self._work, args=(list(history),), name="clusterops-trackers",
                                       daemon=True)
        self.thread.start()

    def feed(self, rec: Mapping) -> None:
        if self.thread is None or self.closed.is_set():
            return
        try:
            self.q.put_nowait(("rec", dict(rec)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.warn(f"trackers: more than {QUEUE_MAX} records waiting; records are dropped until they "
                          "catch up")

    def close(self, outcome: Optional[str] = None, wait_s: float = 30.0) -> bool:
        """Deliver what is queued, end the tracker runs (``outcome``: done, give_up,
        requeue, stopped) and wait at most ``wait_s``; True when all of it finished."""
        if self.thread is None or self.closed.is_set():
            return True
        self.closed.set()
        deadline = time.monotonic() + max(0.0, wait_s)
        try:
            self.q.put(("close", outcome), timeout=max(0.001, wait_s))   # a full queue: wait for room
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self.warn(f"trackers: still writing after {wait_s:g} s; left behind (the next incarnation "
                      "delivers what is missing)")
            return False
        return True

    # -- the worker ------------------------------------------------------------------------
    def _guard(self, i: int, what: str, fn: Callable[[], Any]) -> Any:
        if i in self.failed:
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a tracker must never take supervision down
            kind = self.trackers[i].kind
            hint = f" (pip install 'clusterops[{EXTRAS[kind]}]')" if isinstance(e, ImportError) else ""
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            self.failed[i] = why
            self.warn(f"tracker {kind}: {what} failed: {why}{hint}; nothing more is written to it")
            return None

    def _work(self, history: List[Mapping]) -> None:
        state = load_state(self.job_dir)
        since = state.get("delivered_t")
        since = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None
        for i, t in enumerate(self.trackers):
            got = self._guard(i, "open", lambda t=t, i=i: t.open(dict(state.get(self.keys[i]) or {})))
            if got:
                state[self.keys[i]] = got
        self._save(state)
        for rec in history:
            item = self.figures.take(rec)
            # Replayed for the running figures; delivered only when the last incarnation did not.
            if item is not None and (since is None or float(rec.get("t") or 0) > since):
                self._write(item)
            self._delivered(rec)
        self._flush(state)
        while True:
            kind, payload = self.q.get()
            if kind == "close":
                self._flush(state)
                for i, t in enumerate(self.trackers):
                    self._guard(i, "close", lambda t=t: t.close(payload))
                return
            item = self.figures.take(payload)
            if item is not None:
                self._write(item)
            self._delivered(payload)
            if item is not None and item.marker:
                self._flush(state)

    def _delivered(self, rec: Mapping) -> None:
        t = rec.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            self.delivered_t = max(self.delivered_t or 0.0, float(t))

    def _write(self, item: Item) -> None:
        for i, t in enumerate(self.trackers):
            self._guard(i, "write", lambda t=t: t.write(item))

    def _flush(self, state: Dict[str, Any]) -> None:
        for i, t in enumerate(self.trackers):
            self._guard(i, "flush", lambda t=t: t.flush(self.figures.markers))
        if self.delivered_t is not None:
            state["delivered_t"] = self.delivered_t
        self._save(state)

    def _save(self, state: Dict[str, Any]) -> None:
        from clusterops.fsutil import write_atomic

        try:
            write_atomic(self.job_dir / STATE_FILE, json.dumps(state, sort_keys=True) + "\n")
        except Exception as e:  # noqa: BLE001 - said once, like a tracker's failure
            if not self.state_warned:
                self.state_warned = True
                self.warn(f"trackers: {STATE_FILE} not written ({type(e).__name__}: {e}); a requeued job "
                          "starts new tracker runs")
