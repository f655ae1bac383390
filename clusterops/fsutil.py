"""Small filesystem helpers shared by the reporting code."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from clusterops.errors import ClusteropsError


def write_atomic(path: os.PathLike | str, text: str, mode: int = 0o644) -> None:
    """Write text through a temporary sibling, fsync, then rename over ``path``: a reader
    (node_exporter, a browser) sees the old file or the new one, never half of one."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=str(p.parent), prefix=f".{p.name}.", suffix=".tmp")
    except OSError as e:
        raise ClusteropsError(f"{p}: cannot write: {e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
