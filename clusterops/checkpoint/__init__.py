"""Checkpoints on disk: atomic commit, validation, latest-good lookup, retention, shrink.

A checkpoint is a directory ``step_<N>`` (N zero-padded to 8 digits) under a
checkpoint root. It is written into a temporary sibling (``.tmp.step_<N>.<host>.<pid>.<rand>``),
every file is fsynced, a manifest (``manifest.json``: step, time, world size, each
file's size and hash) is written last and fsynced, and then the temporary directory
is renamed to ``step_<N>`` in one atomic ``rename(2)``; finally the root directory is
fsynced so the rename itself is durable (and the parent of a root the save created).
A step that already exists is swapped with ``renameat2(RENAME_EXCHANGE)``, or where
the filesystem refuses that, replaced in two renames whose gap lookups bridge with the
``.prev.`` copy. A writer holds ``flock`` on ``.lock.<suffix>`` for the whole save; that
lock, not the pid in a name, tells a live writer's temporary from a dead one's.
Anything without a valid manifest is not a checkpoint, and reading a malformed one
(odd paths, FIFOs, symlinks, deep JSON) is a reported problem, never a hang or a crash.

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
``manifest_written`` (manifest fsynced, before the rename), ``exchange`` (a step that
already exists is about to be replaced: action ``einval`` makes the rename-exchange
fail as on a filesystem that refuses it, so the two-phase fallback runs),
``prev_moved`` (fallback only: the old directory moved aside, the new one not yet in
place), ``renamed`` (after the rename, before the directory fsync), ``committed`` (all
done). Several ``point:action`` specs may be given, separated by commas.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import secrets
import re
import shutil
import signal
import socket
import stat
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional

from clusterops.errors import ClusteropsError, InputError
from clusterops.runner import pid_alive

log = logging.getLogger(__name__)

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
FAULT_ENV = "CLUSTEROPS_CKPT_FAULT"
# A temporary directory of a writer we cannot prove dead (another host) is only
# treated as dead after this long.
STALE_TMP_S = 6 * 3600.0

_TMP_RE = re.compile(r"^\.(?P<kind>tmp|trash|prev|lock)\.(?P<suffix>step_(?P<step>\d{1,19})\.(?P<host>[^.]*)"
                     r"\.(?P<pid>\d{1,10})\.[0-9a-f]+)$")

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
        if digits.isdigit() and digits.isascii() and len(digits) <= MAX_STEP_DIGITS:
            return int(digits)
    return None


def _host() -> str:
    return socket.gethostname().split(".")[0].replace(".", "_") or "host"


def _suffix(step: int) -> str:
    """``step_<N>.<host>.<pid>.<random>``: shared by a writer's lock, temporary and old copy."""
    return f"{step_dir_name(step)}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def _tmp_name(kind: str, step: int) -> str:
    return f"{kind}{_suffix(step)}"


# ----------------------------------------------------------------------------- faults


def fault_point(name: str) -> None:
    """Act on CLUSTEROPS_CKPT_FAULT if it names this point (test hook, no-op otherwise)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for one in spec.split(","):
        point, _, action = one.partition(":")
        if point == name:
            _fault_act(name, action or "kill")


def fault_armed(name: str) -> bool:
    """True when CLUSTEROPS_CKPT_FAULT names this point."""
    return any(one.partition(":")[0] == name for one in os.environ.get(FAULT_ENV, "").split(","))


def _fault_act(name: str, action: str) -> None:
    log.warning("checkpoint fault injection at %s: %s", name, action)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action == "einval":
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
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


def _make_root(root: Path) -> None:
    """mkdir -p root, fsyncing the parent of every directory it creates.

    Without the parent's fsync a crash can lose the new root's directory entry, and
    with it every checkpoint committed under it.
    """
    if root.is_dir():
        return
    created = []
    p = root
    while not os.path.lexists(p) and p != p.parent:
        created.append(p)
        p = p.parent
    root.mkdir(parents=True, exist_ok=True)
    for d in reversed(created):
        _fsync_dir(d.parent)


# Linux renameat2(2) flags (include/uapi/linux/fs.h).
_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# errnos with which a filesystem (or an old kernel/libc) says "no rename-exchange here".
_NO_EXCHANGE_ERRNOS = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)
_renameat2_fn = None


def renameat2(src: os.PathLike, dst: os.PathLike, flags: int) -> None:
    """Linux renameat2(2) through ctypes; OSError(ENOSYS) where libc lacks it."""
    global _renameat2_fn
    import ctypes

    if _renameat2_fn is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
        if fn is None:
            raise OSError(errno.ENOSYS, "renameat2 not available in this libc")
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _renameat2_fn = fn
    if _renameat2_fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(src), None, str(dst))


class WriterLock:
    """A lock file ``.lock.<suffix>`` held with flock(2) by a writer for a whole save.

    A live writer is recognised by its held lock, not by its pid: a pid recorded in a
    name means nothing across PID namespaces (containers) or hosts. The lock is
    released by the kernel when the writer dies, however it dies. Where the
    filesystem has no flock (some Lustre mounts) the file still exists and the
    temporaries are then judged by age only.
    """

    def __init__(self, root: Path, suffix: str):
        self.path = root / f"{LOCK_PREFIX}{suffix}"
        self.held = False
        self.fd: Optional[int] = None
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()
        for _ in range(50):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    # A prune probing this (random, so ours alone) name holds it for an
                    # instant; try again.
                    os.close(fd)
                    time.sleep(0.01)
                    continue
                log.warning("no flock on %s (%s): temporaries there are judged by age only", root, e.strerror)
            # A prune may have removed the file between our open and flock (it saw it
            # unlocked): then lock a fresh one.
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same or not self.held:
                os.write(fd, body)
                self.fd = fd
                return
            os.close(fd)
            self.held = False
        raise CheckpointError(f"{self.path}: could not take the writer lock")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def lock_state(root: os.PathLike, suffix: str) -> str:
    """The state of the writer lock of suffix: "live" (a running writer holds it),
    "free" (the lock file exists and nobody holds it: its writer is gone), "absent"
    (no lock file) or "unknown" (it cannot be probed: no flock on this filesystem)."""
    path = os.path.join(root, f"{LOCK_PREFIX}{suffix}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "unknown"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "unknown"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return "live" if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else "unknown"
        return "free"
    finally:
        os.close(fd)  # also drops the probe's lock


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
        self.lock: Optional[WriterLock] = None
        if tmp_path is None:
            _make_root(self.root)
            # Put back what a writer killed mid-replace left aside (it holds no lock now).
            with contextlib.suppress(OSError, CheckpointError):
                restore_interrupted(self.root)
            self.suffix = _suffix(self.step)
            # The lock exists (and is held) before the temporary does, so a prune never
            # sees our temporary without a live lock.
            self.lock = WriterLock(self.root, self.suffix)
            tmp_path = self.root / f"{TMP_PREFIX}{self.suffix}"
            try:
                os.mkdir(tmp_path)
            except BaseException:
                self.lock.release()
                raise
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
        if fault_armed("mid_write") and not self.files:
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
        old = self._install()
        fault_point("renamed")
        _fsync_dir(self.root)
        self.committed = True
        if old is not None:
            _remove_tree(old, self.root)
        if self.lock is not None:
            self.lock.release()
        fault_point("committed")
        return self.final_path

    def _install(self) -> Optional[Path]:
        """Put the temporary in place as step_<N>; returns where the old copy went.

        A new step is one rename(2). A step that already exists (the same step saved
        again after a resume, a shrink, a broken leftover) is swapped with
        renameat2(RENAME_EXCHANGE): at every instant step_<N> is the old or the new
        directory, and the old one ends up under the temporary's name. Where the
        filesystem refuses the exchange (EINVAL, ENOSYS, EOPNOTSUPP), two renames:
        the old directory to ``.prev.<suffix>`` (which lookups use while step_<N> is
        missing and the next save or prune puts back if we die here), then the new
        one into place.
        """
        final = self.final_path
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            st = None
        if st is None:
            try:
                os.rename(self.path, final)
                return None
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
            st = os.lstat(final)  # another writer committed this step meanwhile
        if not stat.S_ISDIR(st.st_mode):
            # A file, FIFO or symlink under a checkpoint's name is not a checkpoint.
            aside = self.root / _tmp_name(TRASH_PREFIX, self.step)
            os.rename(final, aside)
            os.rename(self.path, final)
            return aside
        try:
            fault_point("exchange")
            renameat2(self.path, final, RENAME_EXCHANGE)
            return self.path
        except OSError as e:
            if e.errno not in _NO_EXCHANGE_ERRNOS:
                raise
            log.info("rename-exchange refused under %s (%s); replacing step %d in two renames",
                     self.root, e.strerror, self.step)
        suffix = getattr(self, "suffix", None) or self.path.name[len(TMP_PREFIX):]
        prev = self.root / f"{PREV_PREFIX}{suffix}"
        os.rename(final, prev)
        fault_point("prev_moved")
        os.rename(self.path, final)
        return prev

    def abort(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.lock is not None:
                self.lock.release()


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


def _show(name: str) -> str:
    """A name from disk or a manifest, safe for a one-line message."""
    return name if name.isprintable() and name.strip() == name and name else repr(name)


def _hidden_step(name: str) -> Optional[int]:
    m = _TMP_RE.match(name)
    return int(m.group("step")) if m else None


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
    """Read a regular file without following a symlink or blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError("is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError("not a regular file")
        if st.st_size > limit:
            raise CheckpointError(f"too large ({st.st_size} bytes > {limit})")
        chunks, total = [], 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > limit:
                raise CheckpointError(f"too large (> {limit} bytes)")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


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
        h = new_hasher(algo)
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
        return h.hexdigest()
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
            seen.add(s)
        elif name.startswith(PREV_PREFIX):
            ps = _hidden_step(name)
            if ps is not None and (ps not in prevs or name < prevs[ps]):
                prevs[ps] = name
    out.extend((s, name) for s, name in prevs.items() if s not in seen)
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


# ----------------------------------------------------------------------------- retention


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


def shrink(path: os.PathLike, *, unsafe_load: bool = False) -> ShrinkReport:
    """Re-save the torch files of a committed checkpoint without oversized storages.

    The new version is written and committed like any checkpoint (temporary sibling,
    manifest, rename-exchange with the old directory), replacing it only when complete.
    Files are loaded with weights_only=True: a file that needs pickled code (custom
    classes) is refused with UnsafeLoadRefused unless unsafe_load=True, which runs
    that code and is only for checkpoints from a trusted source.
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
        pending.commit(world_size=m.get("world_size", 1), kind=m.get("kind", "torch"), meta=meta)
    except BaseException as e:
        pending.abort()
        raise wrap_save_error(e, path.parent, step) from e
    after = verify(path).size_bytes
    return ShrinkReport(path, before, after, shrunk, rewritten)
