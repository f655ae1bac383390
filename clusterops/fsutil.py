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
