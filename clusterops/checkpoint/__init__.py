"""Checkpoints on disk: atomic commit, validation, latest-good lookup, retention, shrink.

A checkpoint is a directory ``step_<N>`` (N zero-padded to 8 digits) under a
checkpoint root. It is written into a temporary sibling (``.tmp.step_<N>.<host>.<pid>.<rand>``),
every file is fsynced, a manifest (``manifest.json``: step, time, world size, each
file's size and hash) is written last and fsynced, and then the temporary directory
is renamed to ``step_<N>`` in one atomic ``rename(2)``; finally the root directory is
fsynced so the rename itself is durable. Anything without a valid manifest is not a
checkpoint.

The lookup never trusts a pointer file: it scans the committed directories newest
first, checks each manifest and the file sizes (and the hashes with ``deep=True``),
and returns the first good one, reporting the ones it skipped.

Only the standard library is imported at module level; torch is imported by the
functions that need it (save/load of tensors, shrink), so the CLI's list/verify/
prune/latest stay light.

Fault injection (for tests): the environment variable ``CLUSTEROPS_CKPT_FAULT`` set
to ``<point>:<action>`` makes the writer stop at a named point of a save; action
``kill`` SIGKILLs the process there, ``stop`` SIGSTOPs it (a test then kills it with
SIGKILL), ``enospc`` raises ENOSPC, ``raise`` raises RuntimeError, ``sleep<S>`` sleeps
S seconds (a slow disk). Points, in order: ``begin`` (temporary directory
created), ``mid_write`` (half of the first large file written), ``files_written``
(data files fsynced, no manifest), ``mid_manifest`` (manifest half written),
``manifest_written`` (manifest fsynced, before the rename), ``renamed`` (after the
rename, before the directory fsync), ``committed`` (all done).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import re
import shutil
import signal
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from clusterops.errors import ClusteropsError, InputError
from clusterops.runner import pid_alive

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = "clusterops-checkpoint"
FORMAT_VERSION = 1
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
HASH_ALGOS = ("crc32", "sha256", "blake2b")
# crc32 (zlib, ~2 GB/s on one core) by default: it catches truncation, flipped bytes
# and torn writes, and hashing while writing costs little next to the write itself.
# sha256/blake2b (~1 GB/s) when tampering matters more than save time;
# CLUSTEROPS_CKPT_HASH picks the default for a whole job.
DEFAULT_HASH = os.environ.get("CLUSTEROPS_CKPT_HASH", "crc32")
if DEFAULT_HASH not in HASH_ALGOS:
    DEFAULT_HASH = "crc32"
FAULT_ENV = "CLUSTEROPS_CKPT_FAULT"
# A temporary directory of a writer we cannot prove dead (another host) is only
# treated as dead after this long.
STALE_TMP_S = 6 * 3600.0

_TMP_RE = re.compile(r"^\.(?:tmp|trash)\.(?:step_\d+)\.(?P<host>[^.]*)\.(?P<pid>\d+)\.[0-9a-f]+$")

# Large writes are hashed on a worker thread while the main thread copies them to the
# file (both release the GIL), and a flusher thread starts writeback every
# FLUSH_EVERY_BYTES so the final fsync only waits for the tail.
_PARALLEL_HASH_MIN = 1 << 20
FLUSH_EVERY_BYTES = 64 << 20


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
        if digits.isdigit() and digits.isascii():
            return int(digits)
    return None


def _tmp_name(kind: str, step: int) -> str:
    host = socket.gethostname().split(".")[0].replace(".", "_") or "host"
    return f"{kind}{step_dir_name(step)}.{host}.{os.getpid()}.{secrets.token_hex(4)}"


# ----------------------------------------------------------------------------- faults


def fault_point(name: str) -> None:
    """Act on CLUSTEROPS_CKPT_FAULT if it names this point (test hook, no-op otherwise)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, action = spec.partition(":")
    if point != name:
        return
    action = action or "kill"
    log.warning("checkpoint fault injection at %s: %s", name, action)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action == "raise":
        raise RuntimeError(f"injected fault at {name}")
    elif action.startswith("sleep"):
        time.sleep(float(action[5:] or 1))


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


def hash_file(path: os.PathLike, algo: str = DEFAULT_HASH, chunk_bytes: int = 8 << 20) -> str:
    h = new_hasher(algo)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _fsync_dir(path: os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_disk_full(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class HashingWriter:
    """A binary file that hashes what is written to it and fsyncs on close.

    Used as the file object given to torch.save, so the hash costs no second read
    of the data. Large writes are hashed on a worker thread while the main thread
    writes them; a flusher thread starts writeback as the file grows.
    """

    def __init__(self, path: os.PathLike, algo: str = DEFAULT_HASH, *, fault_at_bytes: Optional[int] = None):
        self.path = Path(path)
        self.algo = algo
        self._h = new_hasher(algo)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.size = 0
        self._closed = False
        self._pool: Optional[ThreadPoolExecutor] = None
        self._flush_lock = threading.Lock()
        self._flush_thread: Optional[threading.Thread] = None
        self._flushed_at = 0
        self._flush_error: Optional[BaseException] = None
        self._fault_at_bytes = fault_at_bytes
        self.error: Optional[BaseException] = None

    # file protocol used by torch.save
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def write(self, data) -> int:
        try:
            return self._write(data)
        except BaseException as e:
            self.error = e
            raise

    def _write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if self._fault_at_bytes is not None and self.size + n >= self._fault_at_bytes:
            cut = max(0, self._fault_at_bytes - self.size)
            self._write_all(mv[:cut])
            self.size += cut
            self._fault_at_bytes = None
            fault_point("mid_write")
            mv = mv[cut:]
            n = mv.nbytes
        if n >= _PARALLEL_HASH_MIN:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
            fut = self._pool.submit(self._h.update, mv)
            try:
                self._write_all(mv)
            finally:
                fut.result()
        else:
            self._h.update(mv)
            self._write_all(mv)
        self.size += n
        if self.size - self._flushed_at >= FLUSH_EVERY_BYTES:
            self._kick_flush()
        return n

    def _write_all(self, mv: memoryview) -> None:
        while mv.nbytes:
            k = os.write(self._fd, mv)
            mv = mv[k:]

    def _kick_flush(self) -> None:
        if self._flush_thread is not None and self._flush_thread.is_alive():
            return
        self._flushed_at = self.size
        self._flush_thread = threading.Thread(target=self._flush_bg, name="ckpt-flush", daemon=True)
        self._flush_thread.start()

    def _flush_bg(self) -> None:
        try:
            os.fdatasync(self._fd)
        except BaseException as e:  # surfaced by close()
            self._flush_error = e

    def close(self) -> None:
        """fsync and close; raises if anything failed."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._flush_thread is not None:
                self._flush_thread.join()
            if self._flush_error is not None:
                raise self._flush_error
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        if not self._closed:
            self._closed = True
            if self._flush_thread is not None:
                self._flush_thread.join()
            os.close(self._fd)
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


# ----------------------------------------------------------------------------- writing


class PendingCheckpoint:
    """A checkpoint being written: a temporary sibling directory until commit().

    Files are added with open_file() (hashed while written) or record_file() (hashed
    from disk); commit() writes the manifest last and renames the directory into place.
    """

    def __init__(self, root: os.PathLike, step: int, *, algo: str = DEFAULT_HASH, tmp_path: Optional[Path] = None):
        self.root = Path(root)
        self.step = int(step)
        self.algo = algo
        new_hasher(algo)  # validate early
        self.final_path = self.root / step_dir_name(self.step)
        self.files: Dict[str, Dict[str, Any]] = {}
        self.committed = False
        if tmp_path is None:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp_path = self.root / _tmp_name(TMP_PREFIX, self.step)
            os.mkdir(tmp_path)
        self.path = Path(tmp_path)
        fault_point("begin")

    # -- adding files
    def open_file(self, relname: str, *, fault_at_bytes: Optional[int] = None) -> HashingWriter:
        target = self.path / relname
        target.parent.mkdir(parents=True, exist_ok=True)
        return HashingWriter(target, self.algo, fault_at_bytes=fault_at_bytes)

    def finish_file(self, relname: str, w: HashingWriter) -> None:
        w.close()
        self.files[relname] = {"size": w.size, "hash": w.hexdigest()}

    def record_file(self, relname: str, *, size: Optional[int] = None, digest: Optional[str] = None) -> None:
        """Add a file already written (and fsynced) into the temporary directory."""
        p = self.path / relname
        if digest is None:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)  # cheap when the writer already did; required when it did not
            finally:
                os.close(fd)
            digest = hash_file(p, self.algo)
        if size is None:
            size = p.stat().st_size
        self.files[relname] = {"size": int(size), "hash": digest}

    def write_torch(self, relname: str, obj: Any) -> None:
        """torch.save obj into relname, hashing while writing, then fsync."""
        import torch

        fault_bytes = None
        if os.environ.get(FAULT_ENV, "").startswith("mid_write") and not self.files:
            fault_bytes = max(1, _estimate_tensor_bytes(obj) // 2)
        w = self.open_file(relname, fault_at_bytes=fault_bytes)
        try:
            with _torch_record_crc_off():
                torch.save(obj, w)
        except BaseException as e:
            w.abandon()
            raise (w.error or e) if isinstance(w.error, OSError) else e
        self.finish_file(relname, w)

    # -- commit / abort
    def manifest(self, *, world_size: int = 1, kind: str = "torch", meta: Optional[dict] = None) -> dict:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "time": time.time(),
            "world_size": int(world_size),
            "kind": kind,
            "hash_algo": self.algo,
            "files": {k: self.files[k] for k in sorted(self.files)},
            "meta": meta or {},
        }

    def commit(self, *, world_size: int = 1, kind: str = "torch", meta: Optional[dict] = None) -> Path:
        fault_point("files_written")
        # fsync the subdirectories (DCP or nested files) and the temp dir's entries.
        for d in sorted({(self.path / k).parent for k in self.files}, key=lambda p: len(p.parts), reverse=True):
            if d != self.path:
                _fsync_dir(d)
        data = json.dumps(self.manifest(world_size=world_size, kind=kind, meta=meta), indent=1, sort_keys=True).encode()
        fd = os.open(self.path / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            half = len(data) // 2
            os.write(fd, data[:half])
            fault_point("mid_manifest")
            mv = memoryview(data)[half:]
            while mv.nbytes:
                mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.path)
        fault_point("manifest_written")
        trash = None
        if os.path.lexists(self.final_path):
            # A directory for this step exists (a broken one, or the same step saved
            # again after a resume): move it aside first; until the next rename the
            # previous step is the latest good one.
            trash = self.root / _tmp_name(TRASH_PREFIX, self.step)
            os.rename(self.final_path, trash)
        os.rename(self.path, self.final_path)
        fault_point("renamed")
        _fsync_dir(self.root)
        self.committed = True
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        fault_point("committed")
        return self.final_path

    def abort(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)


_crc_option_lock = threading.Lock()


@contextlib.contextmanager
def _torch_record_crc_off():
    """Skip torch.save's own CRC32 of every zip record while we write.

    The manifest's hash, computed while writing, already covers every byte of the
    file, and torch.load does not check the record CRCs; computing both would hash
    the data twice. The option is process-wide, so it is set under a lock and put
    back right after (a concurrent plain torch.save in another thread would only
    skip its record CRCs for that moment).
    """
    import torch.serialization as ts

    if not hasattr(ts, "set_crc32_options"):
        yield
        return
    with _crc_option_lock:
        prev = ts.get_crc32_options()
        ts.set_crc32_options(False)
        try:
            yield
        finally:
            ts.set_crc32_options(prev)


def _estimate_tensor_bytes(obj: Any) -> int:
    import torch

    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def save_torch(root: os.PathLike, step: int, files: Dict[str, Any], *, world_size: int = 1,
               meta: Optional[dict] = None, algo: str = DEFAULT_HASH) -> Path:
    """Commit a checkpoint made of torch.save'd objects: {relname: object}."""
    pending = None
    try:
        pending = PendingCheckpoint(root, step, algo=algo)
        for relname, obj in files.items():
            pending.write_torch(relname, obj)
        return pending.commit(world_size=world_size, kind="torch", meta=meta)
    except BaseException as e:
        if pending is not None:
            pending.abort()
        raise wrap_save_error(e, root, step) from e


def wrap_save_error(e: BaseException, root: os.PathLike, step: int) -> BaseException:
    if isinstance(e, CheckpointError) or not isinstance(e, Exception):
        return e
    if _is_disk_full(e):
        return CheckpointDiskFull(
            f"checkpoint step {step} not saved: no space left on the filesystem of {root} "
            f"(nothing committed; the previous checkpoints are untouched)")
    return CheckpointError(f"checkpoint step {step} not saved under {root}: {type(e).__name__}: {e} "
                           f"(nothing committed)")


# ----------------------------------------------------------------------------- reading


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


def read_manifest(path: os.PathLike) -> dict:
    """Parse and validate the manifest of a checkpoint directory (CheckpointError if bad)."""
    p = Path(path) / MANIFEST_NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise CheckpointError("no manifest (incomplete or not a checkpoint)") from None
    except OSError as e:
        raise CheckpointError(f"manifest unreadable: {e.strerror}") from None
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"manifest is not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError("manifest has the wrong format marker")
    if m.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"manifest version {m.get('version')!r} not supported")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError("manifest lists no files")
    for name, entry in files.items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("hash"), str) or name.startswith("/") or ".." in Path(name).parts):
            raise CheckpointError(f"manifest entry for {name!r} is malformed")
    if m.get("hash_algo") not in HASH_ALGOS:
        raise CheckpointError(f"manifest names unknown hash algorithm {m.get('hash_algo')!r}")
    if not isinstance(m.get("step"), int):
        raise CheckpointError("manifest has no step")
    return m


def verify(path: os.PathLike, *, deep: bool = False) -> CheckpointInfo:
    """Check one checkpoint directory: manifest, sizes, and with deep=True hashes."""
    path = Path(path)
    step = parse_step(path.name)
    info = CheckpointInfo(path=path, step=step if step is not None else -1, ok=False, deep=deep)
    if not path.is_dir():
        info.problems.append("not a directory" if path.exists() else "does not exist")
        return info
    try:
        m = read_manifest(path)
    except CheckpointError as e:
        info.problems.append(e.message)
        return info
    info.manifest = m
    if step is not None and m["step"] != step:
        info.problems.append(f"manifest says step {m['step']} but directory is {path.name}")
    if step is None:
        info.step = m["step"]
    for name, entry in m["files"].items():
        fp = path / name
        try:
            st = os.stat(fp)
        except FileNotFoundError:
            info.problems.append(f"{name}: missing")
            continue
        if st.st_size != entry["size"]:
            info.problems.append(f"{name}: size {st.st_size} != {entry['size']} in manifest (truncated or changed)")
            continue
        if deep:
            try:
                got = hash_file(fp, m["hash_algo"])
            except OSError as e:
                info.problems.append(f"{name}: unreadable ({e.strerror})")
                continue
            if got != entry["hash"]:
                info.problems.append(f"{name}: {m['hash_algo']} {got} != {entry['hash']} in manifest (corrupt)")
    info.ok = not info.problems
    return info


def committed_steps(root: os.PathLike) -> List[tuple]:
    """[(step, path)] of the step_<N> directories under root, oldest first (not verified)."""
    return [(s, Path(root, name)) for s, name in _scan_steps(root)]


def _scan_steps(root: os.PathLike) -> List[tuple]:
    """[(step, name)] sorted by step; names only (no stat, no Path objects: 10,000 entries are cheap)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError(f"{root}: not a directory") from None
    out = []
    for name in names:
        s = parse_step(name)
        if s is not None:
            out.append((s, name))
    out.sort()
    return out


@dataclass
class Lookup:
    latest: Optional[CheckpointInfo]
    skipped: List[CheckpointInfo]


def find_latest_good(root: os.PathLike, *, deep: bool = False,
                     on_bad: Optional[Callable[[CheckpointInfo], None]] = None) -> Lookup:
    """Newest checkpoint under root that verifies, and the newer ones that did not."""
    skipped = []
    for step, name in reversed(_scan_steps(root)):
        path = Path(root, name)
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


def load_torch(path: os.PathLike, relname: str, *, weights_only: bool = True, map_location="cpu") -> Any:
    import torch

    return torch.load(Path(path) / relname, map_location=map_location, weights_only=weights_only)


# ----------------------------------------------------------------------------- retention


@dataclass
class PrunePlan:
    keep: List[Path]
    remove: List[Path]
    temporaries: List[Path]
    latest_good: Optional[Path]

    def to_dict(self) -> dict:
        return {"keep": [str(p) for p in self.keep], "remove": [str(p) for p in self.remove],
                "temporaries": [str(p) for p in self.temporaries],
                "latest_good": str(self.latest_good) if self.latest_good else None}


def dead_temporaries(root: os.PathLike, *, stale_s: float = STALE_TMP_S, now: Optional[float] = None) -> List[Path]:
    """Temporary/trash directories whose writer is gone.

    Dead means: written on this host by a pid that no longer runs, or not touched for
    stale_s (writers on other hosts, whose pids we cannot check).
    """
    now = time.time() if now is None else now
    me = socket.gethostname().split(".")[0].replace(".", "_")
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        if not (e.name.startswith(TMP_PREFIX) or e.name.startswith(TRASH_PREFIX)):
            continue
        m = _TMP_RE.match(e.name)
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if m and m.group("host") == me and int(m.group("pid")) != os.getpid():
            if not pid_alive(int(m.group("pid"))):
                out.append(Path(e.path))
                continue
        if age > stale_s:
            out.append(Path(e.path))
    return sorted(out)


def plan_prune(root: os.PathLike, keep_last: int, keep_every: Optional[int] = None, *,
               stale_s: float = STALE_TMP_S) -> PrunePlan:
    """Decide what to remove. The latest good checkpoint is always kept.

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
    good = find_latest_good(root).latest
    keep, remove = [], []
    newest = {p for _, p in steps[-keep_last:]}
    for step, path in steps:
        if (path in newest or (good is not None and path == good.path)
                or (keep_every and step % keep_every == 0)):
            keep.append(path)
        else:
            remove.append(path)
    return PrunePlan(keep=keep, remove=remove, temporaries=dead_temporaries(root, stale_s=stale_s),
                     latest_good=good.path if good else None)


def prune(root: os.PathLike, keep_last: int, keep_every: Optional[int] = None, *, dry_run: bool = False,
          stale_s: float = STALE_TMP_S) -> PrunePlan:
    plan = plan_prune(root, keep_last, keep_every, stale_s=stale_s)
    if dry_run:
        return plan
    for p in plan.remove:
        # Rename first so a half-deleted directory is never mistaken for a checkpoint;
        # a trash name carries our pid, so a prune killed midway is cleaned next time.
        doomed = Path(root) / _tmp_name(TRASH_PREFIX, parse_step(p.name))
        try:
            os.rename(p, doomed)
        except FileNotFoundError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    for p in plan.temporaries:
        shutil.rmtree(p, ignore_errors=True)
    return plan


# ----------------------------------------------------------------------------- shrink


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


def shrink(path: os.PathLike) -> ShrinkReport:
    """Re-save the torch files of a committed checkpoint without oversized storages.

    The new version is written and committed like any checkpoint (temporary sibling,
    manifest, rename), replacing the old directory only when it is complete.
    """
    path = Path(path)
    info = verify(path, deep=True)
    if not info.ok:
        raise CheckpointError(f"{path}: not a good checkpoint ({'; '.join(info.problems)}); not shrinking it")
    m = info.manifest
    step = parse_step(path.name)
    if step is None:
        raise CheckpointError(f"{path}: not a step_<N> directory")
    before = info.size_bytes
    pending = PendingCheckpoint(path.parent, step, algo=m["hash_algo"])
    rewritten, shrunk = [], 0
    try:
        for name, entry in m["files"].items():
            src = path / name
            obj, n = None, 0
            if name.endswith(".pt"):
                obj = load_torch(path, name, weights_only=False)
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
        pending.commit(world_size=m.get("world_size", 1), kind=m.get("kind", "torch"), meta=meta)
    except BaseException as e:
        pending.abort()
        raise wrap_save_error(e, path.parent, step) from e
    after = verify(path).size_bytes
    return ShrinkReport(path, before, after, shrunk, rewritten)
