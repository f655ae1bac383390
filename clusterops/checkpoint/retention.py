"""Retention: what a prune keeps, removes and puts back under a checkpoint root.

The latest good checkpoint (decided with every hash checked) is never removed, and
nothing is removed when no checkpoint passes that check. Hidden entries are sorted by
their writer's lock (see :mod:`clusterops.checkpoint.locks`): a live writer's are left
alone; a dead writer's are removed, except the only copy of a step (a dead ``.prev.``,
or a dead ``.tmp.`` whose manifest verifies with hashes), which is renamed back to
``step_<N>``. Directories are removed by renaming them to ``.trash.`` first, so a
half-deleted directory never keeps a checkpoint's name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from clusterops.checkpoint.format import (_TMP_RE, LOCK_PREFIX, PREV_PREFIX, TMP_PREFIX, TRASH_PREFIX, _fsync_dir,
                                          _hidden_step, _host, _tmp_name, parse_step, step_dir_name)
from clusterops.checkpoint.locks import lock_state
from clusterops.checkpoint.lookup import committed_steps, find_latest_good, verify
from clusterops.errors import InputError
from clusterops.runner import pid_alive

log = logging.getLogger(__name__)

# A temporary directory of a writer we cannot prove dead (another host) is only
# treated as dead after this long.
STALE_TMP_S = 6 * 3600.0


@dataclass
class PrunePlan:
    keep: List[Path]
    remove: List[Path]
    temporaries: List[Path]
    latest_good: Optional[Path]
    restore: List[tuple] = field(default_factory=list)   # [(from, to)]: interrupted replaces put back
    note: str = ""

    def to_dict(self) -> dict:
        return {"keep": [str(p) for p in self.keep], "remove": [str(p) for p in self.remove],
                "temporaries": [str(p) for p in self.temporaries],
                "restore": [[str(a), str(b)] for a, b in self.restore],
                "latest_good": str(self.latest_good) if self.latest_good else None,
                "note": self.note}


@dataclass
class Leftovers:
    remove: List[Path]          # dead temporaries, trash, free lock files
    restore: List[tuple]        # [(from, to step_<N>)]: the only copy of a step, put back in place
    live: List[Path]            # temporaries of writers that are still running


def _writer_dead(root: str, m, age_s: float, stale_s: float) -> bool:
    """Is the writer of a hidden entry (matched by _TMP_RE) gone?"""
    st = lock_state(root, m.group("suffix"))
    if st == "live":
        return False
    if st == "free":
        return True
    if st == "unknown":  # a lock file we cannot probe (no flock here): age only
        return age_s > stale_s
    # No lock file: an entry of an older clusterops. Its pid is only meaningful on
    # this host and in this PID namespace, so age decides unless the pid is gone here.
    if age_s > stale_s:
        return True
    return m.group("host") == _host() and not pid_alive(int(m.group("pid")))


def scan_leftovers(root: os.PathLike, *, stale_s: float = STALE_TMP_S, now: Optional[float] = None) -> Leftovers:
    """Sort the hidden entries of a root: what a prune removes, restores, or leaves alone.

    A ``.tmp.``/``.prev.`` entry whose writer holds its lock is live. A dead
    ``.prev.`` (an interrupted two-phase replace) is put back as step_<N> when that
    name is missing; so is a dead ``.tmp.`` that is complete (its manifest verifies
    with hashes) when its step has no directory: the only copy of a step is never
    deleted. Everything else dead is removed.
    """
    now = time.time() if now is None else now
    rootp = os.fspath(root)
    out = Leftovers([], [], [])
    try:
        entries = list(os.scandir(rootp))
    except (OSError, ValueError):
        return out
    present = {parse_step(e.name) for e in entries} - {None}
    hidden = []
    for e in entries:
        if not e.name.startswith((TMP_PREFIX, TRASH_PREFIX, PREV_PREFIX, LOCK_PREFIX)):
            continue
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        hidden.append((e, _TMP_RE.match(e.name), age))
    # .prev. first (they restore the old copy), then .tmp., then the rest.
    order = {"prev": 0, "tmp": 1, "trash": 2, "lock": 3}
    hidden.sort(key=lambda x: (order.get(x[1].group("kind"), 4) if x[1] else 4, x[0].name))
    for e, m, age in hidden:
        p = Path(e.path)
        if m is None:  # not a name we make: only age can tell
            if age > stale_s:
                out.remove.append(p)
            continue
        kind, step = m.group("kind"), int(m.group("step"))
        if kind == "lock":
            st = lock_state(rootp, m.group("suffix"))
            if st == "free" or (st == "unknown" and age > stale_s):
                out.remove.append(p)
            continue
        if not _writer_dead(rootp, m, age, stale_s):
            out.live.append(p)
            continue
        if kind in ("prev", "tmp") and step not in present and e.is_dir(follow_symlinks=False):
            if kind == "prev" or verify(p, deep=True).ok:
                out.restore.append((p, Path(rootp, step_dir_name(step))))
                present.add(step)
                continue
        out.remove.append(p)
    out.remove.sort()
    return out


def dead_temporaries(root: os.PathLike, *, stale_s: float = STALE_TMP_S, now: Optional[float] = None) -> List[Path]:
    """Temporary, trash and lock entries whose writer is gone (what prune removes)."""
    return scan_leftovers(root, stale_s=stale_s, now=now).remove


def restore_interrupted(root: os.PathLike, *, stale_s: float = STALE_TMP_S) -> List[tuple]:
    """Put back the only copies of steps that a dead writer left under hidden names."""
    done = []
    for src, dst in scan_leftovers(root, stale_s=stale_s).restore:
        try:
            os.rename(src, dst)  # fails if step_<N> appeared meanwhile (non-empty)
        except OSError as e:
            log.warning("could not restore %s as %s: %s", src, dst, e.strerror)
            continue
        log.warning("restored %s as %s (left by a writer that died while replacing it)", src, dst)
        done.append((src, dst))
    if done:
        _fsync_dir(root)
    return done


def _remove_tree(p: Path, root: os.PathLike) -> None:
    """Remove a directory by renaming it to a trash name first (a half-deleted
    directory never keeps a checkpoint's name); files, FIFOs and symlinks are unlinked."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
        return
    doomed = p
    if not p.name.startswith(TRASH_PREFIX):
        step = parse_step(p.name)
        if step is None:
            step = _hidden_step(p.name) or 0
        doomed = Path(root) / _tmp_name(TRASH_PREFIX, step)
        try:
            os.rename(p, doomed)
        except FileNotFoundError:
            return
    shutil.rmtree(doomed, ignore_errors=True)


def plan_prune(root: os.PathLike, keep_last: int, keep_every: Optional[int] = None, *,
               stale_s: float = STALE_TMP_S) -> PrunePlan:
    """Decide what to remove. The latest good checkpoint is always kept.

    "Latest good" is decided with every hash checked (deep), so a newest checkpoint
    whose bytes flipped can never make an older, really good one look removable.
    When no checkpoint passes the hash check, no checkpoint is removed at all.
    keep_last counts committed directories from the newest (good or not); keep_every
    keeps steps that are multiples of K. Broken directories older than the latest good
    one are removed unless kept by those rules; broken ones newer than it are kept
    (they may be under inspection) only if keep_last covers them.
    """
    if keep_last < 1:
        raise InputError(f"--keep-last must be >= 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise InputError(f"--keep-every must be >= 1, got {keep_every}")
    steps = committed_steps(root)
    good = find_latest_good(root, deep=True).latest
    leftovers = scan_leftovers(root, stale_s=stale_s)
    keep, remove = [], []
    newest = {p for _, p in steps[-keep_last:]}
    for step, path in steps:
        if (good is None or path in newest or path == good.path
                or (keep_every and step % keep_every == 0)):
            keep.append(path)
        else:
            remove.append(path)
    note = "" if good is not None or not steps else "no checkpoint passed the hash check; none removed"
    return PrunePlan(keep=keep, remove=remove, temporaries=leftovers.remove,
                     latest_good=good.path if good else None, restore=leftovers.restore, note=note)


def prune(root: os.PathLike, keep_last: int, keep_every: Optional[int] = None, *, dry_run: bool = False,
          stale_s: float = STALE_TMP_S) -> PrunePlan:
    if not dry_run:
        if keep_last < 1 or (keep_every is not None and keep_every < 1):
            return plan_prune(root, keep_last, keep_every, stale_s=stale_s)  # raises InputError
        restored = restore_interrupted(root, stale_s=stale_s)
    plan = plan_prune(root, keep_last, keep_every, stale_s=stale_s)
    if dry_run:
        return plan
    plan.restore = restored
    for p in plan.remove:
        _remove_tree(p, root)
    for p in plan.temporaries:
        _remove_tree(p, root)
    return plan

