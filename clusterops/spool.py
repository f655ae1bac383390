"""Record a node's health check in the fleet history, never failing the check.

``clusterops health check --db URL`` (or ``$CLUSTEROPS_HISTORY_DB``, or ``history: {db:
URL}`` in the health site config) stores each check's report in the history database
(:mod:`clusterops.history`: PostgreSQL for a fleet, SQLite for one host). The check
must stay cheap and must pass or fail on the node's health alone, so:

- the report is first written to a local spool directory (one small JSON file), then
  every spooled file, oldest first, is stored and removed; a database that is down or
  slow (connecting is bounded by ``timeout_s``) leaves the files for a later run;
- the spool is bounded (``max_files``, ``max_bytes``): when full, the oldest reports go
  first, and the report says how many were dropped;
- one flush at a time per spool (a non-blocking ``flock``); a check that finds another
  flushing just leaves its file for it or the next run;
- storing is idempotent (each report carries a unique id), so a flush cut short and
  repeated neither loses nor doubles a row.

Nothing here raises: :func:`record` returns what happened (``recorded``, ``pending``,
``dropped``, ``error``) for the report's ``history`` key.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from clusterops.errors import InputError, where

SPOOL_ENV = "CLUSTEROPS_HEALTH_SPOOL"
DEFAULT_MAX_FILES = 2000
DEFAULT_MAX_BYTES = 32 << 20
DEFAULT_TIMEOUT_S = 3.0
FLUSH_BATCH = 500          # files stored per run at most (the rest wait for the next run)
SITE_KEYS = {"db", "spool_dir", "spool_max_files", "spool_max_bytes", "timeout_s"}


def default_spool_dir() -> Path:
    env = os.environ.get(SPOOL_ENV)
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/spool/clusterops/health")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "clusterops" / "health-spool"


@dataclass
class RecordSettings:
    target: str
    spool_dir: Path
    max_files: int = DEFAULT_MAX_FILES
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


def settings(db: Optional[str], site: Mapping[str, Any], site_path: Optional[str] = None
             ) -> Optional[RecordSettings]:
    """Where to record: ``--db``, else $CLUSTEROPS_HISTORY_DB, else the site config's
    ``history.db``; None when none is set (nothing is recorded). A bad value is an
    InputError (exit 2, before the check runs)."""
    from clusterops.history import FLEET_DB_ENV, parse_target

    hist = site.get("history") or {}
    if not isinstance(hist, Mapping):
        raise InputError(f"{where(site_path, None, 'history')}: must be a mapping")
    for k in hist:
        if k not in SITE_KEYS:
            raise InputError(f"{where(site_path, None, 'history.' + str(k))}: unknown key; valid: "
                             f"{', '.join(sorted(SITE_KEYS))}")
    target = db or os.environ.get(FLEET_DB_ENV) or hist.get("db")
    if not target:
        return None
    if not isinstance(target, str):
        raise InputError(f"{where(site_path, None, 'history.db')}: must be a path or a URL")
    parse_target(target)   # refuses an unknown scheme now, not after the check

    def num(key: str, default, kind, lo, hi):
        v = hist.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                or not lo <= v <= hi:
            raise InputError(f"{where(site_path, None, 'history.' + key)}: must be a "
                             f"{'whole ' if kind is int else ''}number in [{lo}, {hi}], got {v!r}")
        return kind(v)

    spool = hist.get("spool_dir")
    if spool is not None and not isinstance(spool, str):
        raise InputError(f"{where(site_path, None, 'history.spool_dir')}: must be a directory path")
    return RecordSettings(
        target=target,
        spool_dir=Path(spool).expanduser() if spool else default_spool_dir(),
        max_files=num("spool_max_files", DEFAULT_MAX_FILES, int, 1, 10_000_000),
        max_bytes=num("spool_max_bytes", DEFAULT_MAX_BYTES, int, 4096, 1 << 40),
        timeout_s=num("timeout_s", DEFAULT_TIMEOUT_S, float, 0.5, 120.0))


def _spooled(spool: Path) -> List[Path]:
    try:
        return sorted(p for p in spool.iterdir() if p.name.endswith(".json") and not p.name.startswith("."))
    except OSError:
        return []


def _make_room(spool: Path, s: RecordSettings, incoming: int) -> int:
    """Drop the oldest spooled reports until one more of ``incoming`` bytes fits."""
    files = _spooled(spool)
    sizes = []
    for p in files:
        try:
            sizes.append(p.stat().st_size)
        except OSError:
            sizes.append(0)
    total = sum(sizes)
    dropped = 0
    i = 0
    while i < len(files) and (len(files) - i + 1 > s.max_files or total + incoming > s.max_bytes):
        try:
            files[i].unlink()
            dropped += 1
        except FileNotFoundError:
            pass
        except OSError:
            break
        total -= sizes[i]
        i += 1
    return dropped


def spool_report(report: Mapping[str, Any], s: RecordSettings) -> Dict[str, Any]:
    """Write one report into the spool (atomically: a reader sees all of it or none)."""
    doc = dict(report)
    doc.setdefault("id", uuid.uuid4().hex)
    doc.setdefault("host", socket.gethostname())
    from clusterops.jsonout import dumps

    data = dumps(doc, indent=None).encode()
    s.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    dropped = _make_room(s.spool_dir, s, len(data))
    name = f"{time.time_ns():020d}-{doc['id']}.json"
    tmp = s.spool_dir / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, s.spool_dir / name)
    return {"id": doc["id"], "dropped": dropped}


def flush(s: RecordSettings, *, batch: int = FLUSH_BATCH) -> Dict[str, Any]:
    """Store the spooled reports, oldest first; stop at the first database failure."""
    import fcntl

    from clusterops.errors import ClusteropsError
    from clusterops.history import History, parse_target

    out: Dict[str, Any] = {"recorded": 0, "rows": 0, "error": None}
    s.spool_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(s.spool_dir / ".flush.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # Another check may be flushing this spool: wait a little for it (it may have
        # listed the files before ours arrived), then leave ours for the next run.
        deadline = time.monotonic() + min(s.timeout_s, 2.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    out["busy"] = True
                    return out
                time.sleep(0.05)
        files = _spooled(s.spool_dir)[:batch]
        if not files:
            return out
        try:
            h = History.open(parse_target(s.target), create=True, timeout_s=s.timeout_s)
        except ClusteropsError as e:
            out["error"] = e.message
            return out
        with h:
            done = set()
            while files:
                stored = _store(h, files, out)
                done.update(files)
                if not stored:
                    break
                # Reports spooled meanwhile by checks that found the lock held.
                files = [p for p in _spooled(s.spool_dir) if p not in done][:max(0, batch - len(done))]
        return out
    finally:
        os.close(fd)


MAX_SPOOL_FILE_BYTES = 16 << 20    # a spooled report is a few KiB; more is not one of ours
MAX_BAD_FILES = 200                # set-aside files kept for inspection; older ones go


def _read_spooled(p: Path) -> bytes:
    """A spooled file's bytes: a regular file (no FIFO, device or symlink), bounded."""
    from clusterops.fsutil import read_regular

    data, truncated = read_regular(p, MAX_SPOOL_FILE_BYTES, follow_symlinks=False)
    if truncated:
        raise ValueError(f"too large (over {MAX_SPOOL_FILE_BYTES} bytes)")
    return data


def spooled_problem(doc: Any) -> Optional[str]:
    """Why a decoded spool file is not a check report that can be stored (None if it is)."""
    if not isinstance(doc, dict):
        return f"not a spooled check report (a JSON {type(doc).__name__}, not an object)"
    cid = doc.get("id")
    if not isinstance(cid, str) or not 0 < len(cid) <= 200:
        return "not a spooled check report (no id string)"
    for key in ("node", "status", "profile", "host"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            return f"field {key!r} is not a string"
    if doc.get("time") is not None and (isinstance(doc["time"], bool) or not isinstance(doc["time"], (int, float))):
        return "field 'time' is not a number"
    results = doc.get("results")
    if results is not None and (not isinstance(results, list) or not all(isinstance(r, dict) for r in results)):
        return "field 'results' is not a list of objects"
    return None


def _set_aside(p: Path, why: str) -> Optional[Path]:
    """Rename a spooled file that can never be stored to ``.<name>.bad`` and write its
    reason beside it (``.<name>.bad.why``); unlink it when it cannot be renamed, so it
    never blocks the spool. Keeps the newest MAX_BAD_FILES set-aside files."""
    bad = p.with_name("." + p.name + ".bad")
    try:
        os.replace(p, bad)
    except FileNotFoundError:
        return None
    except OSError:
        try:
            p.unlink()
        except OSError:
            pass
        return None
    try:
        with open(bad.with_name(bad.name + ".why"), "w", encoding="utf-8") as f:
            f.write(why + "\n")
    except OSError:
        pass
    try:
        olds = sorted(x for x in p.parent.iterdir() if x.name.endswith(".json.bad"))
        for x in olds[:max(0, len(olds) - MAX_BAD_FILES)]:
            for y in (x, x.with_name(x.name + ".why")):
                try:
                    y.unlink()
                except OSError:
                    pass
    except OSError:
        pass
    return bad


def _load_spooled(p: Path) -> Any:
    """The report in p, or a str saying why it is not one; None when p vanished."""
    try:
        raw = _read_spooled(p)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"unreadable: {getattr(e, 'strerror', None) or e}"
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except RecursionError:
        return "not valid JSON (nested too deep)"
    except ValueError as e:
        return f"not valid JSON ({' '.join(str(e).split())[:120]})"
    why = spooled_problem(doc)
    return why if why is not None else doc


def _store(h, files: List[Path], out: Dict[str, Any]) -> bool:
    """Store ``files`` in order; False at the first database failure. A file that can
    never be stored (damaged, not a report, refused by the writer for its content) is set
    aside with its reason and the next one is stored: nothing malformed blocks the spool."""
    from clusterops.errors import ClusteropsError

    for p in files:
        doc = _load_spooled(p)
        if doc is None:
            continue
        why = doc if isinstance(doc, str) else None
        if why is None:
            try:
                out["rows"] += h.record_check(doc)
            except ClusteropsError as e:
                out["error"] = e.message
                return False
            except Exception as e:  # noqa: BLE001 - its content, not the database: set it aside
                why = f"cannot be stored: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        if why is not None:
            bad = _set_aside(p, why)
            out["damaged"] = out.get("damaged", 0) + 1
            out["error"] = f"{p.name}: {why}; set aside as {bad.name if bad else 'nothing (removed)'}"
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        out["recorded"] += 1
    return True


def record(report: Mapping[str, Any], s: RecordSettings) -> Dict[str, Any]:
    """Spool this check's report and flush the spool. Never raises."""
    from clusterops.history import parse_target

    res: Dict[str, Any] = {"db": parse_target(s.target).display, "spool": str(s.spool_dir), "recorded": 0,
                           "pending": 0, "dropped": 0, "error": None}
    t0 = time.monotonic()
    try:
        got = spool_report(report, s)
        res["id"] = got["id"]
        res["dropped"] = got["dropped"]
    except (OSError, ValueError, TypeError) as e:
        res["error"] = f"spool {s.spool_dir}: {getattr(e, 'strerror', None) or e}"
        return res
    try:
        f = flush(s)
        res["recorded"] = f["recorded"]
        if f.get("error"):
            res["error"] = f["error"]
        if f.get("busy"):
            res["busy"] = True
    except Exception as e:  # never fail the check because of its history
        res["error"] = f"{type(e).__name__}: {e}"
    res["pending"] = len(_spooled(s.spool_dir))
    res["duration_s"] = round(time.monotonic() - t0, 3)
    if res.get("error"):
        # A driver's message may echo the connection string: never a secret in the report.
        from clusterops.history import redact_text

        res["error"] = redact_text(res["error"], s.target)
    return res
