"""One ``clusterops sweep`` run around ``run_sweep``: everything the command does besides
parsing flags and printing.

``SweepSession(opts, ...).run()`` checks every input first (the options, the history
target, the output files, the profile, the caller's Slurm privilege: a bad one is exit
2 before anything is touched), then holds the sweep's lock (``clusterops.sweep.lock``)
while the history is opened, the sweep runs and the history is pruned; then the webhooks
hear of drains, resumes and guard trips, and the report files (Prometheus textfile,
HTML) are written. It returns a ``SweepOutcome``: the report's document, the exit code,
and why a step fell short. A sweep that cannot run at all is told to the webhooks too and
raised as ``SweepCannotRun`` (exit 5).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Protocol

from clusterops.errors import ClusteropsError, InputError
from clusterops.sweep.lock import SweepLocked, sweep_lock
from clusterops.sweep.options import SweepOptions
from clusterops.sweep.run import EXIT_CANNOT_RUN, EXIT_LOCKED, SweepCannotRun, SweepReport, require_privilege, run_sweep

log = logging.getLogger(__name__)

NOTIFY_WAIT_S = 20.0   # the most a sweep waits at its end for its webhooks


class SweepProgress(Protocol):
    """What a session tells of its progress: the number of targets, each node's result (from
    the sweep's worker threads too), and ``close()`` once the checks are over."""

    def targets(self, n: int) -> None: ...

    def result(self, r) -> None: ...

    def close(self) -> None: ...


@dataclass
class SweepOutcome:
    """What one session did. ``doc`` is the report's document (with ``notifications``
    when webhooks are configured); ``None`` only when another sweep held the lock, and
    then ``locked`` says so in one line (exit 4). ``write_errors``: report files that
    could not be written (the sweep ran, but exits 5). ``guard_message``: the safety
    guard's message when it refused drains of a --drain sweep."""

    exit_code: int
    doc: Optional[dict] = None
    report: Optional[SweepReport] = None
    locked: Optional[str] = None
    write_errors: List[str] = field(default_factory=list)
    guard_message: Optional[str] = None


def check_output(flag: str, path: str) -> None:
    """An output file must be creatable: a regular file or absent, under a directory that
    exists (or can be made) and is writable. Checked before the sweep, not after it."""
    from clusterops.fsutil import check_output_target

    try:
        check_output_target(path)
    except InputError as e:
        raise InputError(f"{flag} {e.message}") from None
    parent = Path(path).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: {parent} is not a writable directory")


class SweepSession:
    """One sweep with its lock, history, webhooks and report files (see the module).
    ``warn`` hears each undelivered notification when it happens (default: the log)."""

    def __init__(self, opts: SweepOptions, *, db: Optional[str] = None, no_history: bool = False,
                 retention_days: float = 90.0, report_path: Optional[str] = None,
                 prom_path: Optional[str] = None, notify_config: Optional[str] = None,
                 warn: Optional[Callable[[str], None]] = None):
        self.opts = opts
        self.db = db
        self.no_history = no_history
        self.retention_days = retention_days
        self.report_path = report_path
        self.prom_path = prom_path
        self.notify_config = notify_config
        self.warn = warn or log.warning

    def run(self, progress: Optional[SweepProgress] = None) -> SweepOutcome:
        """Check the inputs (exit 2), then sweep under the lock, telling ``progress``."""
        from clusterops import notify
        from clusterops.history import default_target, parse_target

        opts = self.opts
        opts.validate()
        if not 0 < self.retention_days < 1e6:
            raise InputError(f"--retention-days: must be positive (and under a million), got {self.retention_days}")
        for flag, path in (("--report", self.report_path), ("--prometheus", self.prom_path)):
            if path:
                check_output(flag, path)
        target = parse_target(self.db if self.db else default_target())
        if target.kind == "sqlite":
            if self.db and target.path.exists() and not target.path.is_file():
                raise InputError(f"--db: {self.db} is not a regular file")
        # One sweep at a time per history: a file lock by a SQLite one, an advisory lock inside
        # a PostgreSQL one (shared by every host that sweeps into it).
        lock = sweep_lock(target, no_history=self.no_history)
        opts.validate_profile()
        require_privilege(opts)   # not a Slurm admin, and the sweep would change nodes: exit 2 now
        notifier = notify.Notifier(notify.load_config(self.notify_config or os.environ.get("CLUSTEROPS_HEALTH_SITE")))
        try:
            return self._locked_run(target, lock, notifier, progress)
        except SweepCannotRun as e:
            notifier.send("sweep_cannot_run", e.message, {"exit_code": EXIT_CANNOT_RUN})
            self._close(notifier)
            raise

    def _locked_run(self, target, lock, notifier, progress) -> SweepOutcome:
        try:
            report = self._sweep(target, lock, progress)
        except SweepLocked as e:
            return SweepOutcome(EXIT_LOCKED, locked=f"another sweep is running ({lock.where} held"
                                f"{': ' + str(e) if str(e) else ''}); not starting a second one")
        except OSError as e:
            raise SweepCannotRun(f"sweep could not run: {lock.where}: {e.strerror or e}") from None
        doc = report.to_dict()
        if notifier.targets:
            from clusterops.notify import sweep_events

            for event, summary, details in sweep_events(doc, self.opts.drain and not self.opts.dry_run):
                notifier.send(event, summary, details)
            self._close(notifier)
            doc["notifications"] = [d.to_dict() for d in notifier.deliveries]
        write_errors = self._write_outputs(doc)
        # The sweep ran, but its outputs for monitoring are missing: not a success.
        code = EXIT_CANNOT_RUN if write_errors else report.exit_code
        plan = report.plan
        guard = plan.message if plan is not None and plan.guard_tripped and self.opts.drain else None
        return SweepOutcome(code, doc=doc, report=report, write_errors=write_errors, guard_message=guard)

    def _sweep(self, target, lock, progress) -> SweepReport:
        """Under the lock: open the history, sweep, prune the history."""
        from clusterops.history import History

        try:
            lock.__enter__()
        except ClusteropsError as e:
            # A lock that cannot even be asked (the PostgreSQL history down): exit 5.
            raise SweepCannotRun(f"sweep could not run: {e.message}") from None
        try:
            try:
                history = None if self.no_history else History.open(target)
            except ClusteropsError as e:
                raise SweepCannotRun(f"sweep could not run: {e.message}") from None
            try:
                report = run_sweep(self.opts, history=history, on_result=progress and progress.result,
                                   on_targets=progress and progress.targets)
                if history is not None:
                    try:
                        history.prune(self.retention_days)
                    except ClusteropsError as e:
                        report.errors.append(f"history not pruned: {e.message}")
                        report.exit_code = EXIT_CANNOT_RUN
                return report
            finally:
                if progress is not None:
                    progress.close()
                if history is not None:
                    history.close()
        finally:
            lock.__exit__(None, None, None)

    def _write_outputs(self, doc: dict) -> List[str]:
        """The Prometheus textfile and the HTML report; -> the errors of those not written."""
        errors: List[str] = []
        if not (self.prom_path or self.report_path):
            return errors
        from clusterops import report as rep

        for path, write in ((self.prom_path, rep.write_prometheus), (self.report_path, rep.write_html)):
            if not path:
                continue
            try:
                write(path, doc)
            except ClusteropsError as e:
                errors.append(e.message)
        return errors

    def _close(self, notifier) -> None:
        for d in notifier.close(NOTIFY_WAIT_S):
            if not d.ok:
                self.warn(f"notification {d.event} not delivered: {d.error}")
