"""Reading committed checkpoints: verify, scan, the latest good one, list, load a file.

The lookup never trusts a pointer file: it scans the ``step_<N>`` directories newest
first, checks each manifest and the file sizes (and the hashes with ``deep=True``), and
returns the first good one with the newer ones it skipped. A ``.prev.`` copy left by an
interrupted two-phase replace stands in for its step while ``step_<N>`` is missing.
Nothing on disk makes :func:`verify` raise or hang: symlinks, FIFOs, odd names and
malformed manifests are problems in its result.

:func:`load_torch` loads one file with ``weights_only=True`` unless the caller opts in;
a file that needs pickled code raises :class:`UnsafeLoadRefused`. torch is imported by
that function only.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, List, Optional

from clusterops.checkpoint.format import (PREV_PREFIX, CheckpointError, _hidden_step, _show, hash_stream,
                                          parse_step, read_manifest, step_dir_name)

log = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    ok: bool
    problems: List[str] = field(default_factory=list)
    manifest: Optional[dict] = None
    deep: bool = False

    @property
    def size_bytes(self) -> int:
        if not self.manifest:
            return 0
        return sum(int(f.get("size", 0)) for f in self.manifest.get("files", {}).values())

    def to_dict(self) -> dict:
        m = self.manifest or {}
        return {
            "path": str(self.path),
            "step": self.step,
            "ok": self.ok,
            "deep": self.deep,
            "problems": list(self.problems),
            "time": m.get("time"),
            "world_size": m.get("world_size"),
            "kind": m.get("kind"),
            "files": len(m.get("files", {})),
            "size_bytes": self.size_bytes,
        }



class _Bad(Exception):
    pass


def _member_stat(base: str, name: str) -> os.stat_result:
    """lstat of a checkpoint member, refusing symlinks, non-directories on the way and
    anything but a regular file at the end (no following a link out of the checkpoint,
    no hanging on a FIFO)."""
    parts = name.split("/")
    cur = base
    for i, part in enumerate(parts):
        cur = os.path.join(cur, part)
        last = i == len(parts) - 1
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise _Bad("missing") from None
        except OSError as e:
            raise _Bad(f"unreadable ({e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise _Bad("is a symlink" if last else f"path goes through a symlink ({_show(part)})")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise _Bad(f"path goes through a non-directory ({_show(part)})")
        if last and not stat.S_ISREG(st.st_mode):
            raise _Bad("not a regular file")
    return st


def _hash_member(path: str, algo: str, chunk_bytes: int = 8 << 20) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Bad("not a regular file")
        with open(fd, "rb", buffering=0, closefd=False) as f:
            return hash_stream(f, algo, chunk_bytes)
    finally:
        os.close(fd)


def verify(path: os.PathLike, *, deep: bool = False) -> CheckpointInfo:
    """Check one checkpoint directory: manifest, sizes, and with deep=True hashes.

    Never raises for what is on disk: anything malformed is a problem in the result.
    """
    path = Path(path)
    step = parse_step(path.name)
    if step is None:
        step = _hidden_step(path.name)  # a .prev. copy found while step_<N> is missing
    info = CheckpointInfo(path=path, step=step if step is not None else -1, ok=False, deep=deep)
    try:
        _verify_into(info, path, step, deep)
    except (OSError, ValueError, RecursionError, CheckpointError, _Bad) as e:
        info.problems.append(f"unreadable: {_show(str(e))[:200]}")
    info.ok = not info.problems
    return info


def _verify_into(info: CheckpointInfo, path: Path, step: Optional[int], deep: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        info.problems.append("does not exist")
        return
    except (OSError, ValueError) as e:
        info.problems.append(f"cannot stat ({getattr(e, 'strerror', None) or e})")
        return
    if stat.S_ISLNK(st.st_mode):
        info.problems.append("is a symlink (a committed checkpoint is a real directory)")
        return
    if not stat.S_ISDIR(st.st_mode):
        info.problems.append("not a directory")
        return
    try:
        m = read_manifest(path)
    except CheckpointError as e:
        info.problems.append(e.message)
        return
    info.manifest = m
    if step is not None and m["step"] != step:
        info.problems.append(f"manifest says step {m['step']} but directory is {path.name}")
    if step is None:
        info.step = m["step"]
    base = os.fspath(path)
    for name, entry in m["files"].items():
        shown = _show(name)
        try:
            st = _member_stat(base, name)
        except _Bad as e:
            info.problems.append(f"{shown}: {e}")
            continue
        if st.st_size != entry["size"]:
            info.problems.append(f"{shown}: size {st.st_size} != {entry['size']} in manifest (truncated or changed)")
            continue
        if deep:
            try:
                got = _hash_member(os.path.join(base, name), m["hash_algo"])
            except _Bad as e:
                info.problems.append(f"{shown}: {e}")
                continue
            except OSError as e:
                info.problems.append(f"{shown}: unreadable ({e.strerror})")
                continue
            if got != entry["hash"]:
                info.problems.append(f"{shown}: {m['hash_algo']} {got} != {entry['hash']} in manifest (corrupt)")


def committed_steps(root: os.PathLike) -> List[tuple]:
    """[(step, path)] of the step_<N> directories under root, oldest first (not verified).

    A ``.prev.`` copy left by a replace interrupted on a filesystem without
    rename-exchange stands in for its step while step_<N> itself is missing.
    """
    return [(s, Path(root, name)) for s, name in _scan_steps(root)]


def _scan_steps(root: os.PathLike) -> List[tuple]:
    """[(step, name)] sorted by step; names only (no stat, no Path objects: 10,000 entries are cheap)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError(f"{root}: not a directory") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{root}: cannot list ({getattr(e, 'strerror', None) or e})") from None
    out = []
    prevs = {}
    seen = set()
    for name in names:
        s = parse_step(name)
        if s is not None:
            out.append((s, name))
            seen.add(name)
        elif name.startswith(PREV_PREFIX):
            ps = _hidden_step(name)
            if ps is not None and (ps not in prevs or name < prevs[ps]):
                prevs[ps] = name
    # A .prev. copy stands in while its step's canonical name is missing (a step_10
    # beside it is another directory, not that step's copy).
    out.extend((s, name) for s, name in prevs.items() if step_dir_name(s) not in seen)
    out.sort()
    return out


@dataclass
class Lookup:
    latest: Optional[CheckpointInfo]
    skipped: List[CheckpointInfo]


def find_latest_good(root: os.PathLike, *, deep: bool = False,
                     on_bad: Optional[Callable[[CheckpointInfo], None]] = None,
                     exclude: Collection = ()) -> Lookup:
    """Newest checkpoint under root that verifies, and the newer ones that did not.

    Paths in exclude (found unloadable by the caller) are passed over silently.
    """
    skipped = []
    for step, name in reversed(_scan_steps(root)):
        path = Path(root, name)
        if path in exclude:
            continue
        info = verify(path, deep=deep)
        if info.ok:
            return Lookup(info, skipped)
        log.info("skipping bad checkpoint %s: %s", path, "; ".join(info.problems))
        skipped.append(info)
        if on_bad is not None:
            on_bad(info)
    return Lookup(None, skipped)


def latest_good(root: os.PathLike, *, deep: bool = False) -> Optional[Path]:
    found = find_latest_good(root, deep=deep).latest
    return found.path if found else None


def list_checkpoints(root: os.PathLike, *, deep: bool = False) -> List[CheckpointInfo]:
    return [verify(p, deep=deep) for _, p in committed_steps(root)]


class UnsafeLoadRefused(CheckpointError):
    """A file needs pickled code to load and weights_only loading refused it."""


def load_torch(path: os.PathLike, relname: str, *, weights_only: bool = True, map_location="cpu") -> Any:
    """torch.load one file of a checkpoint.

    weights_only=True (the default) loads tensors and plain containers only: no code
    from the checkpoint runs. A file that needs pickled code raises UnsafeLoadRefused;
    weights_only=False is the caller's explicit opt-in for a trusted checkpoint. Any
    other failure (damaged content) is a CheckpointError with a one-line message.
    """
    import pickle

    import torch

    target = Path(path) / relname
    try:
        return torch.load(target, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        text = str(e)
        m = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", text, re.S)
        detail = " ".join((m.group(1) if m else text).split())[:200]
        if weights_only and "global" in detail.lower():
            raise UnsafeLoadRefused(
                f"{target}: loading it would run pickled code ({detail}); refused (weights_only=True); "
                f"opt in only for a checkpoint you trust") from None
        raise CheckpointError(f"{target}: cannot be loaded ({detail or type(e).__name__})") from None
    except Exception as e:  # zip, storage and pickle errors on damaged content
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(f"{target}: cannot be loaded ({type(e).__name__}: {_show(first)})") from None

