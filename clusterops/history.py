"""Sweep history in an embedded SQLite database.

Every node's result of every sweep is kept: one row per probe, plus one row with
probe ``check`` for the node's overall verdict (the row the flapping rule and
``clusterops health history`` read first). Old rows go by a retention setting.

Schema (version 1)::

    sweeps(id TEXT PRIMARY KEY, started REAL, finished REAL, via TEXT, profile TEXT,
           nodes INTEGER, failed INTEGER, guard INTEGER, exit_code INTEGER)
    results(id INTEGER PRIMARY KEY, time REAL, sweep_id TEXT, node TEXT, probe TEXT,
            status TEXT, value REAL, unit TEXT, detail TEXT)
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from clusterops.errors import ClusteropsError, InputError

NODE_PROBE = "check"          # the row holding a node's overall verdict
DEFAULT_RETENTION_DAYS = 90.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS sweeps (
    id TEXT PRIMARY KEY, started REAL NOT NULL, finished REAL, via TEXT, profile TEXT,
    nodes INTEGER, failed INTEGER, guard INTEGER, exit_code INTEGER);
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY, time REAL NOT NULL, sweep_id TEXT NOT NULL, node TEXT NOT NULL,
    probe TEXT NOT NULL, status TEXT NOT NULL, value REAL, unit TEXT, detail TEXT);
CREATE INDEX IF NOT EXISTS results_node_probe_time ON results(node, probe, time);
CREATE INDEX IF NOT EXISTS results_time ON results(time);
PRAGMA user_version = 1;
"""


def default_db_path() -> Path:
    """$CLUSTEROPS_SWEEP_DB, else /var/lib/clusterops/sweep.db for root, else
    ~/.local/state/clusterops/sweep.db."""
    env = os.environ.get("CLUSTEROPS_SWEEP_DB")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/clusterops/sweep.db")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "clusterops" / "sweep.db"


def parse_since(text: str, now: Optional[float] = None) -> float:
    """``30m``, ``12h``, ``7d``, ``2w`` (ago), or an ISO date/time -> epoch seconds."""
    now = time.time() if now is None else now
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", t)
    if m:
        mult = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]
        return now - float(m.group(1)) * mult
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise InputError(f"--since: expected e.g. 30m, 12h, 7d or an ISO date, got {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _finite(v: object) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _text(v: object) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return str(v)


# Times a sweep can have written: 1970 .. 9999 (anything else is a damaged row).
_T_MAX = 253402300799.0


@dataclass
class Row:
    time: float
    sweep_id: str
    node: str
    probe: str
    status: str
    value: Optional[float]
    unit: Optional[str]
    detail: Optional[str]

    @classmethod
    def from_db(cls, raw: Sequence[object]) -> Optional["Row"]:
        """A row as stored, typed; None for a row whose time is not a time (a damaged or
        foreign row is skipped, never a crash). Values that are not finite numbers read
        as None."""
        t = _finite(raw[0])
        if t is None or not 0 <= t <= _T_MAX:
            return None
        return cls(t, _text(raw[1]) or "", _text(raw[2]) or "", _text(raw[3]) or "", _text(raw[4]) or "",
                   _finite(raw[5]), _text(raw[6]), _text(raw[7]))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["time_iso"] = datetime.fromtimestamp(self.time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return d


# The columns every reader and writer relies on.
EXPECTED = {"sweeps": ("id", "started", "finished", "via", "profile", "nodes", "failed", "guard", "exit_code"),
            "results": ("id", "time", "sweep_id", "node", "probe", "status", "value", "unit", "detail")}


class History:
    """The sweep database. Open with ``History.open(path)``; one connection per process.

    Every SQLite failure (not a database, a truncated file, a missing table, a locked
    or read-only file) becomes a one-line ClusteropsError naming the file."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path

    @classmethod
    def open(cls, path: os.PathLike | str, *, create: bool = True) -> "History":
        """``create``: the sweep's writer (makes the file and tables). Without it, a
        reader: the file must exist and is opened read-only (reading never changes it)."""
        p = Path(path)
        if p.exists() and not p.is_file():
            raise InputError(f"{p}: not a regular file (a sweep history database is one file)")
        if not create and not p.exists():
            raise ClusteropsError(f"{p}: no sweep history database here (run a sweep first, or give --db)")
        conn = None
        try:
            if create:
                p.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(str(p), timeout=30)
                h = cls(conn, p)
                # Someone else's database (or a damaged one) is refused before anything is
                # written to it; an empty one gets the schema.
                if conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]:
                    h._check_schema()
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(SCHEMA)
            else:
                conn = sqlite3.connect(f"{p.absolute().as_uri()}?mode=ro", uri=True, timeout=30)
                h = cls(conn, p)
            h._check_schema()
            return h
        except sqlite3.DatabaseError as e:
            _close(conn)
            raise InputError(f"{p}: not a usable sweep history database: {e}") from None
        except (OSError, sqlite3.Error) as e:
            _close(conn)
            raise ClusteropsError(f"{p}: cannot open the sweep history database: {e}") from None
        except ClusteropsError:
            _close(conn)
            raise

    def _check_schema(self) -> None:
        for table, cols in EXPECTED.items():
            have = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}
            if not have:
                raise InputError(f"{self.path}: not a sweep history database (no table {table!r})")
            missing = [c for c in cols if c not in have]
            if missing:
                raise InputError(f"{self.path}: not a sweep history database (table {table!r} lacks "
                                 f"{', '.join(missing)})")

    def _query(self, sql: str, args: Sequence[object] = ()) -> List[tuple]:
        try:
            return self.conn.execute(sql, tuple(args)).fetchall()
        except sqlite3.Error as e:
            raise ClusteropsError(f"{self.path}: cannot read the sweep history: {e}") from None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing --------------------------------------------------------------------
    def record(self, report) -> int:
        """Store a sweep report (clusterops.sweep.SweepReport). Returns rows written."""
        rows = []
        t = report.finished
        for name in report.node_order():
            r = report.results[name]
            value = r.duration_s
            rows.append((t, report.sweep_id, name, NODE_PROBE, r.status, value, "s",
                         (r.detail or "")[:500]))
            for k, v in r.metrics.items():
                status = "straggler" if k in r.stragglers else "ok"
                rows.append((t, report.sweep_id, name, f"fleet:{k}", status, v, k.rsplit("_", 1)[-1], ""))
            for p in r.probes:
                val = p.get("value")
                if isinstance(val, bool) or not isinstance(val, (int, float)):
                    val = None
                rows.append((t, report.sweep_id, name, str(p.get("name", "?")), str(p.get("status", "?")),
                             val, p.get("unit"), str(p.get("detail") or "")[:500]))
        counts = report.counts()
        try:
            self._write(report, rows, counts)
        except sqlite3.Error as e:
            raise ClusteropsError(f"{self.path}: cannot record the sweep: {e}") from None
        return len(rows)

    def _write(self, report, rows, counts) -> None:
        with self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO sweeps VALUES (?,?,?,?,?,?,?,?,?)",
                (report.sweep_id, report.started, report.finished, report.options.get("via"),
                 report.options.get("profile"), len(report.results),
                 counts.get("fail", 0) + counts.get("unreachable", 0),
                 int(bool(report.plan and report.plan.guard_tripped)), report.exit_code))
            self.conn.executemany("INSERT INTO results (time, sweep_id, node, probe, status, value, unit, detail)"
                                  " VALUES (?,?,?,?,?,?,?,?)", rows)

    def prune(self, retention_days: float = DEFAULT_RETENTION_DAYS, now: Optional[float] = None) -> int:
        """Delete rows older than the retention; returns how many result rows went."""
        if retention_days <= 0:
            raise InputError(f"--retention-days: must be positive, got {retention_days}")
        cutoff = (time.time() if now is None else now) - retention_days * 86400
        try:
            with self.conn:
                n = self.conn.execute("DELETE FROM results WHERE time < ?", (cutoff,)).rowcount
                self.conn.execute("DELETE FROM sweeps WHERE started < ?", (cutoff,))
        except sqlite3.Error as e:
            raise ClusteropsError(f"{self.path}: cannot prune the sweep history: {e}") from None
        return n

    # -- reading --------------------------------------------------------------------
    def fail_history(self, nodes: Iterable[str], n: int) -> Dict[str, List[bool]]:
        """For each node, whether each of its last ``n`` checked sweeps failed, newest first.

        Skipped sweeps and sweep errors (not the node's fault) do not count.
        """
        out: Dict[str, List[bool]] = {}
        for node in nodes:
            cur = self._query(
                "SELECT status FROM results WHERE node = ? AND probe = ? "
                "AND status NOT IN ('skipped', 'error') ORDER BY time DESC, id DESC LIMIT ?",
                (node, NODE_PROBE, int(n)))
            out[node] = [s in ("fail", "unreachable") for (s,) in cur]
        return out

    def rows(self, node: Optional[str] = None, probe: Optional[str] = None, since: Optional[float] = None,
             limit: Optional[int] = None) -> List[Row]:
        """Rows, oldest first (the last ``limit`` of them when a limit is given)."""
        where, args = [], []
        if node:
            where.append("node = ?")
            args.append(node)
        if probe:
            where.append("probe = ?")
            args.append(probe)
        if since is not None:
            where.append("time >= ?")
            args.append(since)
        sql = "SELECT time, sweep_id, node, probe, status, value, unit, detail FROM results"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY time DESC, id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        found = [row for row in map(Row.from_db, self._query(sql, args)) if row is not None]
        found.reverse()
        return found

    def latest(self, since: Optional[float] = None) -> List[Row]:
        """Each node's most recent overall verdict."""
        # One pass over the index: each node's newest 'check' row (ids grow with time).
        sql = ("SELECT time, sweep_id, node, probe, status, value, unit, detail FROM results "
               "WHERE id IN (SELECT MAX(id) FROM results WHERE probe = ? GROUP BY node)")
        args: List[object] = [NODE_PROBE]
        if since is not None:
            sql += " AND time >= ?"
            args.append(since)
        rows = [row for row in map(Row.from_db, self._query(sql, args)) if row is not None]
        return sorted(rows, key=lambda r: r.node)

    def sweeps(self, limit: int = 20) -> List[dict]:
        cur = self._query("SELECT id, started, finished, via, profile, nodes, failed, guard, exit_code "
                          "FROM sweeps ORDER BY started DESC LIMIT ?", (limit,))
        keys = ("id", "started", "finished", "via", "profile", "nodes", "failed", "guard", "exit_code")
        return [dict(zip(keys, r)) for r in cur]

    def probes(self, node: Optional[str] = None) -> List[str]:
        if node:
            cur = self._query("SELECT DISTINCT probe FROM results WHERE node = ? ORDER BY probe", (node,))
        else:
            cur = self._query("SELECT DISTINCT probe FROM results ORDER BY probe")
        return [_text(p) or "" for (p,) in cur]


def _close(conn) -> None:
    if conn is not None:
        try:
            conn.close()
        except sqlite3.Error:
            pass


def trend(values: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """min / median / max / last of a series (None values ignored)."""
    import statistics

    vals = [v for v in values if _finite(v) is not None]
    if not vals:
        return {"n": 0, "min": None, "median": None, "max": None, "last": None}
    return {"n": len(vals), "min": min(vals), "median": statistics.median(vals), "max": max(vals),
            "last": vals[-1]}


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[Optional[float]]) -> str:
    values = [_finite(v) for v in values]
    vals = [v for v in values if v is not None]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)

    def level(v: float) -> int:
        if hi <= lo:
            return 0
        # Halved so that hi - lo cannot overflow to infinity.
        frac = (v / 2 - lo / 2) / (hi / 2 - lo / 2)
        return min(len(SPARK) - 1, max(0, int(frac * (len(SPARK) - 1))))

    return "".join(" " if v is None else SPARK[level(v)] for v in values)
