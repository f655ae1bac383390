"""A probe's local state between checks: one small JSON file per node and probe.

Probes that judge what changed since the last check (the Xid probe's seen events, the
fabric probe's error counters and link flaps) keep it in
``$CLUSTEROPS_STATE_DIR`` (else ``/var/lib/clusterops``, else ``~/.cache/clusterops``) as
``<kind>-<node>.json``. ``update`` reads, changes and writes it under an exclusive
``flock`` on a lock file beside it, so two checks of the same node at the same second
(the HealthCheckProgram and a preflight) do not lose each other's update; the write is a
private temporary file renamed over the old one, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, TypeVar

from clusterops.fsutil import read_regular_text

# A state file is a few kilobytes; anything bigger is not ours and is read as empty.
STATE_MAX_BYTES = 1 << 20
T = TypeVar("T")


def default_state_file(state_dir: Optional[str], env, node: str, kind: str) -> Path:
    base = state_dir or env.get("CLUSTEROPS_STATE_DIR") or "/var/lib/clusterops"
    if not os.access(base, os.W_OK) and not os.access(os.path.dirname(base.rstrip("/")) or "/", os.W_OK):
        base = os.path.join(os.path.expanduser("~"), ".cache", "clusterops")
    return Path(base) / f"{kind}-{node}.json"


def load_state(path: Path) -> Dict[str, Any]:
    """The saved state, or {} when there is none or it is not a JSON object (a truncated
    file, a file of someone else's)."""
    try:
        doc = json.loads(read_regular_text(path, STATE_MAX_BYTES))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def save_state(path: Path, state: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def update(path: Path, change: Callable[[Dict[str, Any]], T]) -> T:
    """Load the state, let ``change`` edit it in place (and return what the caller
    needs), save it; all under the file's lock. Raises OSError when it cannot be saved."""
    with _locked(path):
        state = load_state(path)
        out = change(state)
        save_state(path, state)
        return out
