"""Writing a checkpoint: hashed files, the manifest last, one atomic rename.

A save takes a writer lock (:mod:`clusterops.checkpoint.locks`), writes every file into
a temporary sibling ``.tmp.step_<N>.<host>.<pid>.<rand>`` (hashed while written, by
:class:`HashingWriter`), fsyncs them, writes the manifest last and fsyncs it and the
directory, renames the directory to ``step_<N>`` in one ``rename(2)`` and fsyncs the
root (and the parent of every directory a save creates for a new root). A step that
already exists is swapped with ``renameat2(RENAME_EXCHANGE)``, or where the filesystem
refuses that, replaced in two renames whose gap lookups bridge with the ``.prev.``
copy. Before a save, what a writer killed mid-replace left aside is put back
(:func:`clusterops.checkpoint.retention.restore_interrupted`). torch is imported by
the functions that save tensors.

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
import logging
import os
import shutil
import signal
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional

from clusterops.checkpoint.format import (DEFAULT_HASH, MANIFEST_NAME, PREV_PREFIX, TMP_PREFIX, TRASH_PREFIX,
                                          CheckpointDiskFull, CheckpointError, _fsync_dir, _suffix, _tmp_name,
                                          build_manifest, hash_file, manifest_bytes, new_hasher, step_dir_name)
from clusterops.checkpoint.locks import WriterLock, warn_node_local_flock
from clusterops.checkpoint.retention import _remove_tree, restore_interrupted

log = logging.getLogger(__name__)

FAULT_ENV = "CLUSTEROPS_CKPT_FAULT"
# Large writes are hashed on a worker thread while the main thread copies them to the
# file (both release the GIL), and a flusher thread starts writeback every
# FLUSH_EVERY_BYTES so the final fsync only waits for the tail.
_PARALLEL_HASH_MIN = 1 << 20
FLUSH_EVERY_BYTES = 64 << 20


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



# ----------------------------------------------------------------------------- files and renames


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



def is_disk_full(exc: BaseException) -> bool:
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
            with contextlib.suppress(OSError, ValueError):
                warn_node_local_flock(self.root)   # once per process and mount
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
    def manifest(self, *, world_size: int = 1, kind: str = "torch", meta: Optional[dict] = None,
                 codec: Optional[int] = None) -> dict:
        return build_manifest(self.step, self.files, algo=self.algo, world_size=world_size, kind=kind, meta=meta,
                              codec=codec)

    def commit(self, *, world_size: int = 1, kind: str = "torch", meta: Optional[dict] = None,
               codec: Optional[int] = None) -> Path:
        fault_point("files_written")
        # fsync the subdirectories (DCP or nested files) and the temp dir's entries.
        for d in sorted({(self.path / k).parent for k in self.files}, key=lambda p: len(p.parts), reverse=True):
            if d != self.path:
                _fsync_dir(d)
        data = manifest_bytes(self.manifest(world_size=world_size, kind=kind, meta=meta, codec=codec))
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
               meta: Optional[dict] = None, algo: str = DEFAULT_HASH, codec: Optional[int] = None) -> Path:
    """Commit a checkpoint made of torch.save'd objects: {relname: object} (``codec``: see build_manifest)."""
    pending = None
    try:
        pending = PendingCheckpoint(root, step, algo=algo)
        for relname, obj in files.items():
            pending.write_torch(relname, obj)
        return pending.commit(world_size=world_size, kind="torch", meta=meta, codec=codec)
    except BaseException as e:
        if pending is not None:
            pending.abort()
        raise wrap_save_error(e, root, step) from e


def wrap_save_error(e: BaseException, root: os.PathLike, step: int) -> BaseException:
    if isinstance(e, CheckpointError) or not isinstance(e, Exception):
        return e
    if is_disk_full(e):
        return CheckpointDiskFull(
            f"checkpoint step {step} not saved: no space left on the filesystem of {root} "
            f"(nothing committed; the previous checkpoints are untouched)")
    return CheckpointError(f"checkpoint step {step} not saved under {root}: {type(e).__name__}: {e} "
                           f"(nothing committed)")

