"""Small filesystem helpers shared by the reporting code."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from clusterops.errors import ClusteropsError, InputError


def check_output_target(path: os.PathLike | str) -> None:
    """Refuse an output path that is not a regular file (or absent): a device such as
    /dev/null, a FIFO, a socket, a directory or a symlink. Writing through a temporary
    file and a rename would replace such an entry (as root, /dev/null itself), and
    opening one blocks (a FIFO) or changes something else's mode (a symlink's target).
    Raises InputError (exit 2)."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise InputError(f"{p}: cannot check the output path: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode):
        return
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
    raise InputError(f"{p}: is {kind}; an output must be a regular file (or not exist yet): refused, "
                     "nothing written")


def write_atomic(path: os.PathLike | str, text: str, mode: int = 0o644, *, create_parents: bool = True) -> None:
    """Write text through a temporary sibling, fsync, then rename over ``path``: a reader
    (node_exporter, a browser) sees the old file or the new one, never half of one.

    ``path`` must be a regular file or absent (see :func:`check_output_target`); nothing
    is ever written through a symlink, a device or a FIFO."""
    p = Path(path)
    check_output_target(p)
    try:
        if create_parents:
            p.parent.mkdir(parents=True, exist_ok=True)
        elif not p.parent.is_dir():
            raise InputError(f"{p}: directory {p.parent} does not exist; nothing written")
        fd, tmp = tempfile.mkstemp(dir=str(p.parent), prefix=f".{p.name}.", suffix=".tmp")
    except OSError as e:
        raise ClusteropsError(f"{p}: cannot write: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ClusteropsError(f"{p}: cannot write: {e.strerror or e}") from None
        raise


class NotRegularFile(OSError):
    """A path that names a FIFO, device, socket or directory where a file's contents are wanted."""


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def read_regular(path: os.PathLike | str, max_bytes: int, *, tail: bool = False,
                 follow_symlinks: bool = True) -> tuple[bytes, bool]:
    """At most ``max_bytes`` of a regular file: (data, truncated).

    For a file named in a profile or on a command line, which may be anything: the open
    never blocks (O_NONBLOCK: a FIFO without a writer), the opened object must be a
    regular file (fstat of the descriptor, so a symlink is judged by what it points at,
    and /dev/zero or a FIFO are refused before a byte is read), and no more than
    ``max_bytes`` are kept. ``tail``: the last ``max_bytes`` (what a log scan needs);
    files that report no size (/proc, /sys) are read through, keeping the end, but never
    past 64 x ``max_bytes``. ``follow_symlinks=False`` refuses a symlink as the last part
    (O_NOFOLLOW). Raises OSError (``NotRegularFile`` for the wrong kind); ``strerror``
    says what is wrong.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(0, f"is {_kind(st.st_mode)}, not a regular file", str(path))
        if not tail:
            data = _read_upto(fd, max_bytes + 1)
            return data[:max_bytes], len(data) > max_bytes
        if st.st_size > max_bytes:
            os.lseek(fd, st.st_size - max_bytes, os.SEEK_SET)
            return _read_upto(fd, max_bytes), True
        kept, truncated, total = b"", False, 0
        while total < 64 * max_bytes:
            chunk = os.read(fd, min(1 << 20, max(max_bytes, 4096)))
            if not chunk:
                break
            total += len(chunk)
            kept += chunk
            if len(kept) > max_bytes:
                kept, truncated = kept[-max_bytes:], True
        else:
            truncated = True
        return kept, truncated
    finally:
        os.close(fd)


def _read_upto(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_regular_text(path: os.PathLike | str, max_bytes: int, *, tail: bool = False) -> str:
    """:func:`read_regular` decoded as UTF-8 (bad bytes replaced); a cut first line of a
    tail is dropped, so a scan never sees half a line."""
    data, truncated = read_regular(path, max_bytes, tail=tail)
    text = data.decode("utf-8", errors="replace")
    if tail and truncated:
        text = text.partition("\n")[2]
    return text
