"""Checkpoints on disk: atomic commit, validation, latest-good lookup, retention, shrink.

A checkpoint is a directory ``step_<N>`` under a checkpoint root, committed only by an
atomic rename of a fully written directory that carries a manifest; anything else on
disk is not a checkpoint. The package, by module:

- :mod:`~clusterops.checkpoint.format`: names, the manifest (build, strict reading),
  hashing, the errors;
- :mod:`~clusterops.checkpoint.locks`: writer locks (is a temporary's writer alive?);
- :mod:`~clusterops.checkpoint.writer`: :class:`PendingCheckpoint`, :func:`save_torch`,
  the hashing writer, the rename-exchange / two-phase commit, fault injection;
- :mod:`~clusterops.checkpoint.lookup`: :func:`verify`, :func:`find_latest_good`,
  :func:`list_checkpoints`, :func:`load_torch` (weights_only);
- :mod:`~clusterops.checkpoint.retention`: :func:`plan_prune`/:func:`prune`, dead
  temporaries, putting back what an interrupted replace left aside;
- :mod:`~clusterops.checkpoint.shrink`: re-saving without oversized storages;
- :mod:`~clusterops.checkpoint.codec`: the SDK's state <-> files, exactly (skeleton and
  tensors; one torch.save file, or DCP for many ranks); imported as a submodule.

Only the standard library is imported at module level; torch is imported by the
functions that need it (save/load of tensors, shrink), so the CLI's list/verify/
prune/latest stay light. The names below are the package's public API
(``from clusterops import checkpoint as ck``).
"""

from clusterops.checkpoint.format import (DEFAULT_HASH, FORMAT, FORMAT_VERSION, HASH_ALGOS, LOCK_PREFIX,
                                          MANIFEST_NAME, MAX_MANIFEST_BYTES, PREV_PREFIX, STEP_PREFIX, TMP_PREFIX,
                                          TRASH_PREFIX, CheckpointDiskFull, CheckpointError, build_manifest,
                                          hash_file, new_hasher, parse_step, read_manifest, step_dir_name)
from clusterops.checkpoint.locks import WriterLock, lock_state
from clusterops.checkpoint.lookup import (CheckpointInfo, Lookup, UnsafeLoadRefused, committed_steps,
                                          find_latest_good, latest_good, list_checkpoints, load_torch, verify)
from clusterops.checkpoint.retention import (HOLDS_FILE, STALE_TMP_S, HoldsUnreadable, Leftovers, PrunePlan,
                                             dead_temporaries, hold, holds, plan_prune, prune, release,
                                             restore_interrupted, scan_leftovers)
from clusterops.checkpoint.shrink import ShrinkReport, shrink, shrink_object
from clusterops.checkpoint.writer import (FAULT_ENV, RENAME_EXCHANGE, HashingWriter, PendingCheckpoint,
                                          fault_armed, fault_point, is_disk_full, save_torch, wrap_save_error)

__all__ = [
    "DEFAULT_HASH", "FORMAT", "FORMAT_VERSION", "HASH_ALGOS", "LOCK_PREFIX", "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES", "PREV_PREFIX", "STEP_PREFIX", "TMP_PREFIX", "TRASH_PREFIX", "CheckpointDiskFull",
    "CheckpointError", "build_manifest", "hash_file", "new_hasher", "parse_step", "read_manifest",
    "step_dir_name",
    "WriterLock", "lock_state",
    "CheckpointInfo", "Lookup", "UnsafeLoadRefused", "committed_steps", "find_latest_good", "latest_good",
    "list_checkpoints", "load_torch", "verify",
    "STALE_TMP_S", "Leftovers", "PrunePlan", "dead_temporaries", "plan_prune", "prune", "restore_interrupted",
    "HOLDS_FILE", "HoldsUnreadable", "hold", "holds", "release",
    "scan_leftovers",
    "ShrinkReport", "shrink", "shrink_object",
    "FAULT_ENV", "RENAME_EXCHANGE", "HashingWriter", "PendingCheckpoint", "fault_armed", "fault_point",
    "is_disk_full", "save_torch", "wrap_save_error",
]
