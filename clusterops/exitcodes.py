"""Exit codes: one ``IntEnum`` per command, the one place each code is written down.

Every member carries the short line its command's ``--help`` epilog prints
(:func:`epilog`) and the text of the docs table (:func:`table`), so the help, the docs
and the code cannot disagree. The tables sit in docs/*.md between
``<!-- exitcodes:NAME -->`` marks: ``python -m clusterops.exitcodes --check ROOT``
compares them with this module, ``--write ROOT`` rewrites them, no argument prints them.
"""

from __future__ import annotations

import re
import sys
import textwrap
from enum import IntEnum
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Type


class _Codes(IntEnum):
    """A command's codes: ``NAME = code, "help line", "docs text"[, "extra column"]``."""

    def __new__(cls, value: int, short: str, meaning: str = "", extra: str = ""):
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj.short = short
        obj.meaning = meaning or short
        obj.extra = extra
        return obj


class Common(_Codes):
    """What every ``clusterops`` command means by 0, 1 and 2."""

    OK = 0, "ok", "ok"
    FAILED = 1, "unhealthy / failed / not found", \
        "the thing checked is unhealthy, the job failed for good, or a job/node was not found"
    USAGE = 2, "usage or input error", "usage or input error: one line naming the file, line and field"


class Supervise(_Codes):
    """``clusterops supervise`` (= the supervised job's exit code)."""

    DONE = 0, "training finished"
    FAILED = 1, "failed for good (e.g. the requeue itself failed)", \
        "failed for good for another reason (e.g. the requeue itself failed)"
    USAGE = 2, "usage or input error", "usage or input error (bad spec)"
    NO_PROGRESS = 3, "no progress: latest checkpoint unchanged across K restarts", \
        "no progress: the latest good checkpoint did not move across `no_progress_restarts` restarts in a row"
    REQUEUE_BUDGET = 4, "requeue budget spent (SLURM_RESTART_COUNT reached max_requeues)", \
        "requeue budget spent: `SLURM_RESTART_COUNT` reached `max_requeues`"
    RESTART_BUDGET = 5, "in-allocation restart budget spent", \
        "in-allocation restart budget spent (`max_restarts`)"
    TOO_FEW_NODES = 6, "too few healthy nodes, and no requeue allowed or able to start the job again"
    STOPPED_NO_REQUEUE = 7, "stopped (time limit / preemption) with checkpoint saved, requeue not allowed", \
        "stopped (time limit / preemption) with the checkpoint saved, but requeueing not allowed"
    DIVERGED = 8, "training diverged: the stability guard stopped it (on_spike/on_nan: stop)", \
        "training diverged: a loss spike or a non-finite value with `on_spike`/`on_nan: stop`; the bad state "\
        "was not saved"
    ROLLBACK_BUDGET = 9, "training diverged again and again: max_rollbacks spent", \
        "the stability guard gave up: `max_rollbacks` rollbacks within `rollback_window_steps`, or no "\
        "checkpoint early enough to roll back to; the last good checkpoint is kept"
    SCRIPT_STOP = 10, "the training script asked to stop (its exit code maps to stop: 17, 93)", \
        "the training script asked not to be restarted: its exit code maps to `stop` in `exit_codes` (Megatron-LM's "\
        "17, nvidia-resiliency-ext's 93 by default)"
    GENERATION_END = 11, ("a chain's generation handed on: a later generation resumes (time limit, preemption, "
                          "too few nodes)"), \
        "a generation of a chain (`chain: N`) ended where a lone job would requeue itself (time limit, preemption, "\
        "too few healthy nodes): the chain's next generation resumes from the latest good checkpoint"
    CHAIN_ENDED = 12, "this generation found its chain ended already: it cancelled the rest and did nothing", \
        "a generation of a chain started after an earlier one had ended the chain (its end marker was there, but "\
        "the queue was not emptied): it cancelled the queued generations and trained nothing"


class HealthCheck(_Codes):
    """``clusterops health check``; the extra column: what happens to the node with --drain-on-fail."""

    HEALTHY = 0, "healthy (warnings allowed)", "healthy: every probe passed or warned", \
        "a clusterops drain whose cause this check re-checked is lifted"
    UNHEALTHY = 1, "unhealthy: a probe failed (drained with --drain-on-fail)", \
        "unhealthy: a probe **failed**", "drained, reason `clusterops:health:<profile>: ...`"
    USAGE = 2, ("bad usage, profile or site config, or --drain-on-fail by a user who is not a Slurm "
                "admin: nothing run, nothing drained"), \
        ("bad usage, profile or site config (one line naming file, line and key); or `--drain-on-fail` "
         "by a user who is not a Slurm admin ([privileges](privileges.md))"), "nothing run, nothing drained"
    GUARD = 3, ("unhealthy, but the fleet guard (or Slurm) refused the drain, or the guard lifted it "
                "again (too many nodes drained at once): node left in service"), \
        ("unhealthy, but the **fleet guard** refused the drain, or lifted it again because too many "
         "nodes drained at the same moment (`guard: undone`), or Slurm refused it (the caller is no "
         "admin) (one line on stderr)"), "left in service"
    ERROR = 4, "error: a probe crashed, timed out or could not check: node left in service", \
        ("**error**: a probe raised, hung past its `timeout_s`, or could not check (one line on "
         "stderr, `ERROR` rows in the report)"), "left in service, never drained"


class Sweep(_Codes):
    """``clusterops sweep``; the extra column: how the systemd unit takes it."""

    OK = 0, "every checked node healthy (skipped nodes allowed)", \
        "every checked node healthy (warnings allowed; skipped nodes do not count)", "success"
    UNHEALTHY = 1, "the sweep ran and at least one node failed, was unreachable, or its check errored", \
        ("the sweep **ran** and at least one node failed, did not answer (`unreachable`), or its check "
         "errored; or a `--pairs` test failed"), "success"
    USAGE = 2, ("usage or input error, or a sweep that drains or resumes nodes (--drain, or via Slurm "
                "without --dry-run) by a user who is not a Slurm admin (nothing run)"), \
        ("usage or input error (one line naming the flag), or a sweep that would drain or resume nodes "
         "(`--drain`, or via Slurm without `--dry-run`) run by a user who is not a Slurm admin "
         "([privileges](privileges.md)); nothing done"), "failed"
    GUARD = 3, ("safety guard: more than --max-drain-fraction would be drained (none was), or the "
                "partition-wide guard (site drain.max_drained_fraction) refused a drain"), \
        ("**safety guard**: more nodes would have been drained than `--max-drain-fraction` allows "
         "(none was), or the partition-wide guard (the site's `drain.max_drained_fraction`) refused a "
         "drain (that node was left in service)"), "failed"
    LOCKED = 4, "another sweep is running (lock held)", \
        "another sweep is running (the lock is held); this one did nothing", "failed"
    CANNOT_RUN = 5, ("the sweep could not run: no Slurm, no usable history database, nothing to sweep "
                     "(or its result could not be recorded)"), \
        ("the sweep **could not run**: no Slurm (no `slurm.conf`, controller not answering), no usable "
         "history database (not a database, wrong schema, not writable), nothing to sweep (empty or "
         "unknown partition); also when it ran but could not record its result in the history "
         "database or write `--prometheus`/`--report`"), "failed"
    INTERRUPTED = 130, "interrupted (Ctrl-C), after cleaning up", \
        "interrupted (Ctrl-C), after cleaning up (see below)", "failed"
    TERMINATED = 143, "terminated (SIGTERM), after cleaning up", \
        "terminated (SIGTERM), after cleaning up (see below)", "failed"


class Ckpt(_Codes):
    """``clusterops ckpt ...``."""

    OK = 0, "ok (list, prune, shrink done; latest found; verify good)", \
        ("done: `list` listed (bad ones included, marked BAD), `latest` found one, `verify` good, "
         "`prune` pruned (or planned with `--dry-run`), `shrink` recommitted or had nothing to do, "
         "`release` released the holds")
    FAILED = 1, ("no good checkpoint (latest); checkpoint bad (verify); shrink refused (bad checkpoint, "
                 "or a file that needs pickled code without --unsafe-load)"), \
        ("`latest`: no good checkpoint; `verify`: the checkpoint is bad (each problem on its own line); "
         "`shrink`: not a good checkpoint, a file cannot be loaded, or a file needs pickled code and "
         "`--unsafe-load` was not given (one `Error:` line, nothing changed); any command: the root "
         "cannot be listed")
    USAGE = 2, "usage error: missing root, root not a directory, bad flag value", \
        ("usage or input error, one `Error:` line, nothing done: ROOT missing or not a directory, PATH "
         "not a directory (`shrink`), PATH not a `step_<N>` directory or not the canonical name of its "
         "step (`shrink step_10`), a path with a NUL byte, a bad flag value (`--keep-last 0`), a step "
         "that is not held (`release`), a holds file that cannot be read (`prune`, `release`)")


class Launch(_Codes):
    """``clusterops launch ...``."""

    OK = 0, "ok"
    FAILED = 1, "Slurm refused the job or failed (the script is not left behind)"
    USAGE = 2, ("bad spec, flag or template: one line naming the file, line and key; nothing is "
                "written or submitted")


class Deploy(_Codes):
    """``clusterops deploy files``."""

    WRITTEN = 0, "the files were written"
    USAGE = 2, "bad --prefix or --out (nothing written)"


#: Table name (the docs marks) -> (the codes, the docs file, the extra column's header).
TABLES: Dict[str, Tuple[Type[_Codes], str, str]] = {
    "common": (Common, "docs/foundation.md", ""),
    "supervise": (Supervise, "docs/supervisor.md", ""),
    "health-check": (HealthCheck, "docs/health.md", "node (with `--drain-on-fail`)"),
    "sweep": (Sweep, "docs/sweep.md", "the systemd unit"),
    "ckpt": (Ckpt, "docs/checkpoint.md", ""),
    "launch": (Launch, "docs/launch.md", ""),
}

#: A line the epilog adds after the codes.
_NOTES = {Common: "Commands document any other code they use.",
          Sweep: 'Only 0 and 1 mean "the sweep did its job" (the systemd unit\'s SuccessExitStatus=1).'}


def epilog(codes: Type[_Codes]) -> str:
    """The ``Exit codes:`` block of a command's ``--help`` (kept as written by click's ``\\b``)."""
    lines = ["\b", "Exit codes:"]
    pad = max(len(str(int(c))) for c in codes) + 2
    for c in codes:
        head = "  " + str(int(c)).ljust(pad)
        wrapped = textwrap.wrap(c.short, width=78 - len(head)) or [""]
        lines.append(head + wrapped[0])
        lines += [" " * len(head) + w for w in wrapped[1:]]
    note = _NOTES.get(codes)
    if note:
        lines.append(note)
    return "\n".join(lines)


def table(codes: Type[_Codes], extra: str = "") -> str:
    """The markdown table of ``codes`` for the docs."""
    if extra:
        out = ["| code | meaning | " + extra + " |", "|---|---|---|"]
        out += [f"| {int(c)} | {c.meaning} | {c.extra} |" for c in codes]
    else:
        out = ["| code | meaning |", "|---|---|"]
        out += [f"| {int(c)} | {c.meaning} |" for c in codes]
    return "\n".join(out)


def _block(name: str) -> str:
    codes, _, extra = TABLES[name]
    return f"<!-- exitcodes:{name} -->\n{table(codes, extra)}\n<!-- /exitcodes:{name} -->"


def _pattern(name: str) -> "re.Pattern[str]":
    return re.compile(rf"<!-- exitcodes:{re.escape(name)} -->\n.*?\n<!-- /exitcodes:{re.escape(name)} -->", re.S)


def drift(root: Path, *, write: bool = False) -> List[str]:
    """What differs between the docs under ``root`` and this module (rewritten when ``write``)."""
    problems = []
    for name, (_, rel, _) in TABLES.items():
        path = Path(root) / rel
        try:
            text = path.read_text()
        except OSError as e:
            problems.append(f"missing: {rel}: {e.strerror}")
            continue
        m = _pattern(name).search(text)
        if m is None:
            problems.append(f"missing: {rel}: no <!-- exitcodes:{name} --> table")
        elif m.group(0) != _block(name):
            problems.append(f"differs: {rel}: exitcodes:{name}")
            if write:
                path.write_text(text[:m.start()] + _block(name) + text[m.end():])
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m clusterops.exitcodes [--check|--write] [ROOT]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = args.pop(0) if args and args[0] in ("--check", "--write") else None
    if mode is None:
        print("\n\n".join(_block(n) for n in TABLES))
        return 0
    root = Path(args[0] if args else ".")
    found = drift(root, write=mode == "--write")
    for p in found:
        print(p)
    return 1 if found and mode == "--check" else 0


if __name__ == "__main__":
    sys.exit(main())
