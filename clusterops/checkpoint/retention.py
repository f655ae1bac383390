"""Retention: what a prune keeps, removes and puts back under a checkpoint root.

The latest good checkpoint (decided with every hash checked) is never removed, and
nothing is removed when no checkpoint passes that check. Hidden entries are sorted by
their writer's lock (see :mod:`clusterops.checkpoint.locks`): a live writer's are left
alone; a dead writer's are removed, except the only copy of a step (a dead ``.prev.``,
or a dead ``.tmp.`` whose manifest verifies with hashes), which is renamed back to
``step_<N>``. Directories are removed by renaming them to ``.trash.`` first, so a
half-deleted directory never keeps a checkpoint's name, and only when they are still the
directory prune judged (same device, inode and mtime as when it listed the root): a step
re-saved by rename-exchange during the deep hash is kept. Where flock is node-local
(:func:`clusterops.checkpoint.locks.node_local_flock`) another host's free lock proves
nothing, and its entries are judged by age.

Holds: ``<root>/.clusterops-holds.json`` maps a checkpoint's directory name to why it must
stay (:func:`hold`: the stability guard holds the newest good checkpoint before a loss
spike or NaN, the one a rollback goes, or a person would go, back to). A prune keeps every
held checkpoint, and ``ckpt list`` shows the reason; :func:`release` (``ckpt release``) lifts
holds. The file is rewritten atomically under a flock (``.clusterops-holds.lock``); a prune
refuses a root whose holds file cannot be read, as what it holds is then unknown.
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
from typing import Dict, List, Optional, Tuple

from clusterops.checkpoint.format import (_TMP_RE, LOCK_PREFIX, PREV_PREFIX, TMP_PREFIX, TRASH_PREFIX, _fsync_dir,
                                          _hidden_step, _host, _tmp_name, parse_step, step_dir_name)
from clusterops.checkpoint.locks import lock_state, node_local_flock
from clusterops.checkpoint.lookup import committed_steps, find_latest_good, verify
from clusterops.errors import InputError
from clusterops.runner import pid_alive

log = logging.getLogger(__name__)

# A temporary directory of a writer we cannot prove dead (another host) is only
# treated as dead after this long.
STALE_TMP_S = 6 * 3600.0


# What a directory was when a prune judged it: (st_dev, st_ino, st_mtime_ns). A re-save
# by rename-exchange puts another directory (another inode) under the same name.
Identity = Tuple[int, int, int]


def identity(path: os.PathLike) -> Optional[Identity]:
    """The identity of path itself (not following a symlink); None when it is gone."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


HOLDS_FILE = ".clusterops-holds.json"
HOLDS_LOCK = ".clusterops-holds.lock"


class HoldsUnreadable(InputError):
    """The holds file exists but cannot be read: what it holds is unknown."""


def _read_holds(root: os.PathLike) -> Dict[str, str]:
    """The holds under ``root``; {} without a file; HoldsUnreadable when one is there but
    cannot be read or is not a mapping of step directories to reasons."""
    import json

    path = os.path.join(root, HOLDS_FILE)
    try:
        with open(path) as f:
            body = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise HoldsUnreadable(f"{path}: cannot be read ({e})") from None
    if not isinstance(body, dict):
        raise HoldsUnreadable(f"{path}: not a JSON object of step directories to reasons")
    return {str(k): str(v) for k, v in body.items() if isinstance(k, str) and parse_step(k) is not None}


def holds(root: os.PathLike) -> Dict[str, str]:
    """Directory name -> why it is held, of the checkpoints held under ``root``. An unreadable
    holds file holds nothing here (said in the log); :func:`prune` refuses to run on one."""
    try:
        return _read_holds(root)
    except HoldsUnreadable as e:
        log.warning("%s; no checkpoint held", e.message)
        return {}


HOLDS_LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def _holds_locked(root: os.PathLike, wait_s: float = HOLDS_LOCK_WAIT_S):
    """The holds file's writers one at a time (the supervisor holding while a person releases).
    The lock file is the owner's alone (0600), and the wait is bounded: a lock held longer
    raises TimeoutError (an OSError, which the supervisor records as a warning) rather than
    stall the supervisor."""
    import fcntl

    fd = os.open(os.path.join(root, HOLDS_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{os.path.join(root, HOLDS_LOCK)}: held by another process for "
                                       f"{wait_s:g} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _write_holds(root: os.PathLike, current: Dict[str, str]) -> Path:
    import json

    final = Path(root) / HOLDS_FILE
    if not current:
        with contextlib.suppress(FileNotFoundError):
            final.unlink()
        return final
    tmp = final.with_name(f"{HOLDS_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, final)
    return final


def hold(root: os.PathLike, step: int, reason: str) -> Path:
    """Hold checkpoint ``step`` under ``root`` (prune keeps it) with ``reason``; OSError when the
    holds file cannot be written. An unreadable holds file is set aside as ``<file>.bad``
    (kept for a look) and a new one started."""
    with _holds_locked(root):
        try:
            current = _read_holds(root)
        except HoldsUnreadable as e:
            log.warning("%s; set aside as %s.bad", e.message, HOLDS_FILE)
            os.replace(os.path.join(root, HOLDS_FILE), os.path.join(root, HOLDS_FILE + ".bad"))
            current = {}
        current[step_dir_name(step)] = str(reason)
        return _write_holds(root, current)


def release(root: os.PathLike, steps: Optional[List[int]] = None) -> Dict[str, str]:
    """Lift the holds on ``steps`` (every hold when None) and return what was released (name ->
    reason). A step that is not held is an InputError and nothing is released; so is an
    unreadable holds file (fix or remove it by hand: what it holds is unknown)."""
    with _holds_locked(root):
        current = _read_holds(root)
        if steps is None:
            gone = dict(current)
        else:
            names = [step_dir_name(s) for s in steps]
            missing = [n for n in names if n not in current]
            if missing:
                held = ", ".join(sorted(current)) or "none"
                raise InputError(f"{os.path.join(root, HOLDS_FILE)}: {', '.join(missing)} not held (held: {held})")
            gone = {n: current[n] for n in names}
        _write_holds(root, {k: v for k, v in current.items() if k not in gone})
        return gone


@dataclass
class PrunePlan:
    keep: List[Path]
    remove: List[Path]
    temporaries: List[Path]
    latest_good: Optional[Path]
    restore: List[tuple] = field(default_factory=list)   # [(from, to)]: interrupted replaces put back
    note: str = ""
    # Each victim's identity when it was judged (listed before the deep hash).
    judged: Dict[Path, Optional[Identity]] = field(default_factory=dict)
    # Victims left in place because they changed since they were judged (re-saved meanwhile).
    changed: List[Path] = field(default_factory=list)
    held: Dict[Path, str] = field(default_factory=dict)   # kept because held (:func:`hold`): why

    def to_dict(self) -> dict:
        return {"keep": [str(p) for p in self.keep], "remove": [str(p) for p in self.remove],
                "temporaries": [str(p) for p in self.temporaries],
                "restore": [[str(a), str(b)] for a, b in self.restore],
                "latest_good": str(self.latest_good) if self.latest_good else None,
                "changed": [str(p) for p in self.changed],
                "held": {str(p): why for p, why in self.held.items()},
                "note": self.note}


@dataclass
class Leftovers:
    remove: List[Path]          # dead temporaries, trash, free lock files
    restore: List[tuple]        # [(from, to step_<N>)]: the only copy of a step, put back in place
    live: List[Path]            # temporaries of writers that are still running


def _lock_state(root: str, m, local_flock: bool) -> str:
    """lock_state, except that where flock is node-local (Lustre localflock, NFS
    local_lock/nolock) a free lock of another host's writer proves nothing: "unknown"."""
    st = lock_state(root, m.group("suffix"))
    if st == "free" and local_flock and m.group("host") != _host():
        return "unknown"
    return st


def _writer_dead(root: str, m, age_s: float, stale_s: float, local_flock: bool = False) -> bool:
    """Is the writer of a hidden entry (matched by _TMP_RE) gone?"""
    st = _lock_state(root, m, local_flock)
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
    # By name, not by number: a step_10 next to a missing step_00000010 does not make
    # the only copy of step 10 under a hidden name removable.
    present = {e.name for e in entries if parse_step(e.name) is not None}
    local_flock = node_local_flock(rootp) is not None
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
            st = _lock_state(rootp, m, local_flock)
            if st == "free" or (st == "unknown" and age > stale_s):
                out.remove.append(p)
            continue
        if not _writer_dead(rootp, m, age, stale_s, local_flock):
            out.live.append(p)
            continue
        if kind in ("prev", "tmp") and step_dir_name(step) not in present and e.is_dir(follow_symlinks=False):
            if kind == "prev" or verify(p, deep=True).ok:
                out.restore.append((p, Path(rootp, step_dir_name(step))))
                present.add(step_dir_name(step))
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


def _remove_tree(p: Path, root: os.PathLike, expect: Optional[Identity] = None) -> bool:
    """Remove a directory by renaming it to a trash name first (a half-deleted
    directory never keeps a checkpoint's name); files, FIFOs and symlinks are unlinked.

    With ``expect`` (the identity p had when it was judged), p is removed only if it is
    still that same directory: checked right before the rename, and again on what the
    rename moved (a re-save may swap in a new directory in between, which is then put
    back). Returns False when p was left alone because it changed.
    """
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return True
    if expect is not None and (st.st_dev, st.st_ino, st.st_mtime_ns) != expect:
        return False
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
        return True
    doomed = p
    if not p.name.startswith(TRASH_PREFIX):
        step = parse_step(p.name)
        if step is None:
            step = _hidden_step(p.name) or 0
        doomed = Path(root) / _tmp_name(TRASH_PREFIX, step)
        try:
            os.rename(p, doomed)
        except FileNotFoundError:
            return True
        moved = identity(doomed)
        if expect is not None and (moved is None or moved[:2] != expect[:2]):
            # Swapped between the check and the rename: what we moved is the new copy.
            try:
                os.rename(doomed, p)   # p is free unless yet another save filled it
            except OSError as e:
                log.warning("%s changed while being pruned and could not be put back (%s); it stays as %s",
                            p, e.strerror, doomed)
            return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


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
    # Identities first: the deep hash below can take long, and a directory re-saved by
    # exchange meanwhile is not the one judged here.
    judged = {path: identity(path) for _, path in steps}
    good = find_latest_good(root, deep=True).latest
    leftovers = scan_leftovers(root, stale_s=stale_s)
    keep, remove = [], []
    newest = {p for _, p in steps[-keep_last:]}
    held = _read_holds(root)   # unreadable: refuse (InputError), what it holds is unknown
    for step, path in steps:
        if (good is None or path in newest or path == good.path or path.name in held
                or (keep_every and step % keep_every == 0)):
            keep.append(path)
        else:
            remove.append(path)
    note = "" if good is not None or not steps else "no checkpoint passed the hash check; none removed"
    return PrunePlan(keep=keep, remove=remove, temporaries=leftovers.remove,
                     latest_good=good.path if good else None, restore=leftovers.restore, note=note,
                     judged={p: judged.get(p) for p in remove},
                     held={p: held[p.name] for p in keep if p.name in held})


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
    for p in list(plan.remove):
        expect = plan.judged.get(p)
        if expect is None or not _remove_tree(p, root, expect):
            # Gone or changed since it was judged (re-saved meanwhile): not what was judged.
            if identity(p) is not None:
                log.warning("not removing %s: it changed since prune judged it (re-saved meanwhile)", p)
                plan.remove.remove(p)
                plan.changed.append(p)
    for p in plan.temporaries:
        _remove_tree(p, root)
    return plan

