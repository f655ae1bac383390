"""Shrink: re-save a committed checkpoint without oversized tensor storages.

A tensor saved as a view of a larger storage (a slice, a shard of a flat buffer) drags
the whole storage into the file. :func:`shrink` loads each ``.pt`` file (with
``weights_only=True`` unless the caller opts in), clones such tensors, and commits the
result like any save (temporary sibling, manifest, rename-exchange with the old
directory); files with nothing to shrink are copied with their recorded hash.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List

from clusterops.checkpoint.format import CheckpointError, require_canonical
from clusterops.checkpoint.lookup import UnsafeLoadRefused, load_torch, verify
from clusterops.checkpoint.writer import PendingCheckpoint, wrap_save_error


@dataclass
class ShrinkReport:
    path: Path
    bytes_before: int
    bytes_after: int
    tensors_shrunk: int
    files_rewritten: List[str]

    def to_dict(self) -> dict:
        return {"path": str(self.path), "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "tensors_shrunk": self.tensors_shrunk, "files_rewritten": self.files_rewritten}


def shrink_object(obj: Any) -> tuple:
    """Copy of obj where every tensor whose storage is larger than its view is cloned.

    Returns (new_obj, number_of_tensors_shrunk). Tensors that share one storage are
    cloned once per view, which is what a saved-and-reloaded state needs anyway.
    """
    import torch

    count = 0

    def walk(o):
        nonlocal count
        if isinstance(o, torch.Tensor):
            view_bytes = o.numel() * o.element_size()
            if o.untyped_storage().nbytes() > view_bytes:
                count += 1
                return o.clone(memory_format=torch.contiguous_format)
            return o
        if isinstance(o, dict):
            return type(o)((k, walk(v)) for k, v in o.items()) if type(o) is not dict else {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return tuple(walk(v) for v in o)
        return o

    return walk(obj), count


def shrink(path: os.PathLike, *, unsafe_load: bool = False) -> ShrinkReport:
    """Re-save the torch files of a committed checkpoint without oversized storages.

    The new version is written and committed like any checkpoint (temporary sibling,
    manifest, rename-exchange with the old directory), replacing it only when complete.
    Files are loaded with weights_only=True: a file that needs pickled code (custom
    classes) is refused with UnsafeLoadRefused unless unsafe_load=True, which runs
    that code and is only for checkpoints from a trusted source.
    """
    path = Path(path)
    # Before anything else: the commit writes step_dir_name(step), and a directory with
    # another spelling of the same step (step_10) would swap with that unrelated one.
    step = require_canonical(path, "shrinking")
    info = verify(path, deep=True)
    if not info.ok:
        raise CheckpointError(f"{path}: not a good checkpoint ({'; '.join(info.problems)}); not shrinking it")
    m = info.manifest
    before = info.size_bytes
    pending = PendingCheckpoint(path.parent, step, algo=m["hash_algo"])
    rewritten, shrunk = [], 0
    try:
        for name, entry in m["files"].items():
            src = path / name
            obj, n = None, 0
            if name.endswith(".pt"):
                try:
                    obj = load_torch(path, name, weights_only=not unsafe_load)
                except UnsafeLoadRefused as e:
                    raise UnsafeLoadRefused(f"{e.message}; not shrinking it (--unsafe-load to allow)") from None
                obj, n = shrink_object(obj)
            if n:
                shrunk += n
                rewritten.append(name)
                pending.write_torch(name, obj)
            else:
                dst = pending.path / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                with open(dst, "rb+") as f:
                    os.fsync(f.fileno())
                pending.record_file(name, size=entry["size"], digest=entry["hash"])
        if not rewritten:
            pending.abort()
            return ShrinkReport(path, before, before, 0, [])
        meta = dict(m.get("meta") or {}, shrunk_from_bytes=before)
        pending.commit(world_size=m.get("world_size", 1), kind=m.get("kind", "torch"), meta=meta,
                       codec=m.get("state_codec"))  # the state's files keep their codec
    except BaseException as e:
        pending.abort()
        raise wrap_save_error(e, path.parent, step) from e
    after = verify(path).size_bytes
    return ShrinkReport(path, before, after, shrunk, rewritten)
