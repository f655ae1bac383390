"""The on-disk format of a checkpoint: names, the manifest, hashing, strict reading.

A committed checkpoint is a directory ``step_<N>`` (N zero-padded to 8 digits) under a
checkpoint root holding its files and ``manifest.json`` (step, time, world size, kind,
hash algorithm, each file's size and hash). Hidden siblings share one name scheme,
``.<kind>.step_<N>.<host>.<pid>.<random>``: ``.tmp.`` (a save in progress or a dead
one), ``.prev.`` (the old copy of a step being replaced without rename-exchange),
``.trash.`` (being removed), ``.lock.`` (a writer's lock file).

Reading is bounded and strict: a manifest is a regular file (no symlink, FIFO or
device) of at most MAX_MANIFEST_BYTES, strict JSON, every field of the right type and
every file name a normalized relative path; anything else is a CheckpointError with a
one-line message. Standard library only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import re
import secrets
import socket
import time
import zlib
from typing import Any, Dict, Optional

from clusterops.errors import ClusteropsError, InputError
from clusterops.fsutil import NotRegularFile, read_regular

MANIFEST_NAME = "manifest.json"
FORMAT = "clusterops-checkpoint"
FORMAT_VERSION = 1
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
# The old copy of a step being replaced on a filesystem without rename-exchange: found
# by lookups while step_<N> is missing, restored by the next save or prune.
PREV_PREFIX = ".prev."
# A writer's lock file, held with flock(2) for the whole save; same suffix as its
# temporary directory.
LOCK_PREFIX = ".lock."
# A manifest larger than this is not one of ours (10,000 DCP files take about 1 MB).
MAX_MANIFEST_BYTES = 64 << 20
# Steps are int64 in practice; longer digit strings are not checkpoint names.
MAX_STEP_DIGITS = 19
HASH_ALGOS = ("crc32", "sha256", "blake2b")
# crc32 (zlib, ~2 GB/s on one core) by default: it catches truncation, flipped bytes
# and torn writes, and hashing while writing costs little next to the write itself.
# sha256/blake2b (~1 GB/s) when tampering matters more than save time;
# CLUSTEROPS_CKPT_HASH picks the default for a whole job.
DEFAULT_HASH = os.environ.get("CLUSTEROPS_CKPT_HASH", "crc32")
if DEFAULT_HASH not in HASH_ALGOS:
    DEFAULT_HASH = "crc32"

# The step in a hidden name is written canonically (step_dir_name): 8 digits, or more
# without a leading zero. A hidden name with another spelling is not one of ours, so
# nothing is ever put back under a step number read from it.
_TMP_RE = re.compile(r"^\.(?P<kind>tmp|trash|prev|lock)\.(?P<suffix>step_(?P<step>\d{8}|[1-9]\d{8,18})"
                     r"\.(?P<host>[^.]*)\.(?P<pid>\d{1,10})\.[0-9a-f]+)$")


class CheckpointError(ClusteropsError):
    """A checkpoint could not be written, read or found."""


class CheckpointDiskFull(CheckpointError):
    """The filesystem ran out of space (or quota) during a save; nothing was committed."""


# ----------------------------------------------------------------------------- names


def step_dir_name(step: int) -> str:
    if int(step) < 0:
        raise InputError(f"checkpoint step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{int(step):08d}"


def parse_step(name: str) -> Optional[int]:
    """The step of a committed checkpoint directory name, or None."""
    # str methods, not a regex: the lookup runs this over every entry of the root.
    if name.startswith(STEP_PREFIX):
        digits = name[5:]
        if digits.isdigit() and digits.isascii() and len(digits) <= MAX_STEP_DIGITS:
            return int(digits)
    return None


def is_canonical_step_name(name: str) -> bool:
    """True when name is exactly step_dir_name of its step (``step_00000010``, not
    ``step_10``): the only name a save by number writes to."""
    step = parse_step(name)
    return step is not None and name == step_dir_name(step)


def require_canonical(path: os.PathLike, what: str) -> int:
    """The step of a directory about to be rewritten by number; InputError when its name is
    not the canonical name of that step (``step_10`` next to ``step_00000010``: writing
    step 10 would replace the other, unrelated directory)."""
    name = os.path.basename(os.fspath(path).rstrip("/")) or os.fspath(path)
    step = parse_step(name)
    if step is None:
        raise InputError(f"{_show(os.fspath(path))}: not a step_<N> checkpoint directory; not {what} it")
    if name != step_dir_name(step):
        raise InputError(f"{_show(os.fspath(path))}: {_show(name)} is not the canonical name of step {step} "
                         f"({step_dir_name(step)}), which is where {what} would write; rename it first")
    return step


def _host() -> str:
    return socket.gethostname().split(".")[0].replace(".", "_") or "host"


def _suffix(step: int) -> str:
    """``step_<N>.<host>.<pid>.<random>``: shared by a writer's lock, temporary and old copy."""
    return f"{step_dir_name(step)}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def _tmp_name(kind: str, step: int) -> str:
    return f"{kind}{_suffix(step)}"


def _hidden_step(name: str) -> Optional[int]:
    m = _TMP_RE.match(name)
    return int(m.group("step")) if m else None



# ----------------------------------------------------------------------------- hashing


def new_hasher(algo: str):
    if algo == "crc32":
        return _Crc32()
    if algo not in HASH_ALGOS:
        raise CheckpointError(f"unknown hash algorithm {algo!r} (known: {', '.join(HASH_ALGOS)})")
    return hashlib.new(algo)


class _Crc32:
    """hashlib-like wrapper around zlib.crc32 (fast; detects corruption, not tampering)."""

    def __init__(self):
        self._v = 0

    def update(self, data) -> None:
        self._v = zlib.crc32(data, self._v)

    def hexdigest(self) -> str:
        return f"{self._v:08x}"


def hash_stream(f, algo: str = DEFAULT_HASH, chunk_bytes: int = 8 << 20) -> str:
    """Hash an open binary file to its end, through one reused buffer."""
    h = new_hasher(algo)
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    while True:
        n = f.readinto(buf)
        if not n:
            break
        h.update(view[:n])
    return h.hexdigest()


def hash_file(path: os.PathLike, algo: str = DEFAULT_HASH, chunk_bytes: int = 8 << 20) -> str:
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f, algo, chunk_bytes)


def _fsync_dir(path: os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



# ----------------------------------------------------------------------------- the manifest


def _show(name: str) -> str:
    """A name from disk or a manifest, safe for a one-line message."""
    return name if name.isprintable() and name.strip() == name and name else repr(name)



def _reject_constant(c: str):
    raise ValueError(f"{c} is not allowed")


_HEX = frozenset("0123456789abcdef")


def _relname_problem(name: str) -> Optional[str]:
    """Why a manifest's file name is not a plain relative path inside the checkpoint."""
    if not name or len(name) > 4096:
        return "empty or too long"
    if "\x00" in name:
        return "contains a NUL byte"
    try:
        encoded = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return "not encodable as a file name"
    if name.startswith("/"):
        return "absolute path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(name) != name:
        return "not a normalized relative path ('..', '.', '//' or a trailing '/')"
    if any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts) or len(encoded) > 4096:
        return "path component too long"
    if name == MANIFEST_NAME:
        return "names the manifest itself"
    return None


def _read_regular(path: str, limit: int) -> bytes:
    """A regular file of at most ``limit`` bytes, through :func:`fsutil.read_regular` (no
    symlink followed, no FIFO blocked on); CheckpointError says what is wrong."""
    try:
        data, truncated = read_regular(path, limit, follow_symlinks=False)
    except NotRegularFile:
        raise CheckpointError("not a regular file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError("is a symlink") from None
        raise
    if truncated:
        raise CheckpointError(f"too large (> {limit} bytes)")
    return data


def build_manifest(step: int, files: Dict[str, Dict[str, Any]], *, algo: str, world_size: int = 1,
                   kind: str = "torch", meta: Optional[dict] = None, codec: Optional[int] = None) -> dict:
    """The manifest of a checkpoint whose files ({relname: {size, hash}}) are written.

    ``codec``: the version of clusterops.checkpoint.codec that wrote the SDK state
    (``state_codec``); absent for files written without it (readers then use the old loader).
    """
    extra = {} if codec is None else {"state_codec": int(codec)}
    return {**extra,
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "time": time.time(),
        "world_size": int(world_size),
        "kind": kind,
        "hash_algo": algo,
        "files": {k: files[k] for k in sorted(files)},
        "meta": meta or {},
    }


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written to disk."""
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def read_manifest(path: os.PathLike) -> dict:
    """Parse and validate the manifest of a checkpoint directory (CheckpointError if bad).

    Bounded and strict: a regular file (no symlink, FIFO or device) of at most
    MAX_MANIFEST_BYTES, strict JSON (no NaN/Infinity; nesting too deep is refused),
    every field of the right type, every file name a normalized relative path.
    """
    p = os.path.join(os.fspath(path), MANIFEST_NAME)
    try:
        raw = _read_regular(p, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError("no manifest (incomplete or not a checkpoint)") from None
    except CheckpointError as e:
        raise CheckpointError(f"manifest {e.message}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"manifest unreadable: {getattr(e, 'strerror', None) or e}") from None
    try:
        m = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise CheckpointError("manifest is not valid JSON (nested too deep)") from None
    except ValueError as e:
        raise CheckpointError(f"manifest is not valid JSON ({_show(str(e))[:200]})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError("manifest has the wrong format marker")
    version = m.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise CheckpointError(f"manifest version {_show(repr(version))[:40]} not supported")
    if m.get("hash_algo") not in HASH_ALGOS or not isinstance(m.get("hash_algo"), str):
        raise CheckpointError(f"manifest names unknown hash algorithm {_show(repr(m.get('hash_algo')))[:40]}")
    step = m.get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError("manifest has no valid step")
    ws = m.get("world_size")
    if type(ws) is not int or ws < 1:
        raise CheckpointError("manifest has no valid world_size")
    t = m.get("time")
    if type(t) not in (int, float) or t != t or t in (float("inf"), float("-inf")):
        raise CheckpointError("manifest has no valid time")
    if not isinstance(m.get("kind"), str) or not isinstance(m.get("meta", {}), dict):
        raise CheckpointError("manifest has a malformed kind or meta")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError("manifest lists no files")
    for name, entry in files.items():
        why = _relname_problem(name)
        if why is None and not (isinstance(entry, dict) and type(entry.get("size")) is int
                                and entry["size"] >= 0 and isinstance(entry.get("hash"), str)
                                and 0 < len(entry["hash"]) <= 128 and set(entry["hash"]) <= _HEX):
            why = "size or hash missing or malformed"
        if why is not None:
            raise CheckpointError(f"manifest entry {_show(name)[:200]} is malformed: {why}")
    return m

