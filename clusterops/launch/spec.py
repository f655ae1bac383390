"""The job spec: YAML (or a dict) -> a validated, resolved :class:`JobSpec`.

The keys, their types, bounds and defaults are the table ``clusterops.schema.JOB_SPEC``
(with its ``supervise:`` section, ``clusterops.schema.SUPERVISE``); the schema's interpreter
walks it with the job spec's registry of kinds (``SPEC_KINDS``: the schema's ``KINDS``
extended by path, hostlist, time, mem, lines and text), then the rules below tie keys
together (the script must exist, the signal lead must fit the time limit, ``min_nodes`` at
most ``nodes``, ...). Errors are one
line naming the file, the line and the key (``job.yaml:7: nodes: must be an integer from
1 to 100000, got 0``); an unknown key suggests the closest valid one. ``--set key=value``
overrides follow the same rules. Also here: Slurm time strings (``parse_slurm_time``).

Paths in a spec file are relative to the directory of that file (``workdir`` defaults to
it); the resolved spec holds absolute paths, so ``to_dict()`` / ``from_dict()`` round-trip
it exactly (the supervisor rebuilds the spec that way).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from clusterops import schema, yamlio
from clusterops.errors import InputError

LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "srun")
_FIELDS = {f.name: f for f in schema.JOB_SPEC.fields}
_SUPERVISE = {f.name: f for f in schema.SUPERVISE.fields}
REQUIRED_KEYS = tuple(f.name for f in schema.JOB_SPEC.fields if f.required)
DEFAULT_SIGNAL_LEAD_S = _FIELDS["signal_lead_s"].default
#: ``requeue: expedite``: Slurm 25.11's expedited requeue (``--requeue=expedite``).
EXPEDITE = "expedite"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MEM = re.compile(r"\d+[KMGT]?\Z", re.IGNORECASE)


# --------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """A validated, resolved job spec. Build it with load_spec() or from_dict()."""

    name: str
    nodes: int
    launcher: str
    script: str
    args: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()  # ordered (name, value) pairs
    gpus_per_node: int = 0
    nproc_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    exclusive: bool = False
    exclude: Optional[str] = None
    nodelist: Optional[str] = None
    constraint: Optional[str] = None
    segment: Optional[int] = None
    workdir: str = ""
    log_dir: str = ""
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    setup: Tuple[str, ...] = ()
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    requeue: Union[bool, str] = False     # True, False or "expedite" (EXPEDITE)
    chain: int = 1
    master_port: Optional[int] = None
    srun_wait_s: int = 60
    python: str = "python3"
    launcher_args: Tuple[str, ...] = ()
    srun_args: Tuple[str, ...] = ()
    sbatch_args: Tuple[str, ...] = ()
    notify: Tuple[str, ...] = ()          # webhook URLs for the supervisor's job events
    supervise: Optional[Tuple[Tuple[str, Any], ...]] = None  # ordered (key, value) pairs
    # Where the spec came from (for messages); not a spec key, not in to_dict().
    source: Optional[str] = field(default=None, compare=False)

    # -- derived values (pure) ------------------------------------------------
    @property
    def env_dict(self) -> Dict[str, str]:
        return dict(self.env)

    @property
    def supervise_dict(self) -> Optional[Dict[str, Any]]:
        return None if self.supervise is None else dict(self.supervise)

    @property
    def procs_per_node(self) -> int:
        """Ranks per node: nproc_per_node, else GPUs, else (launchers) one per CPU."""
        if self.nproc_per_node:
            return self.nproc_per_node
        if self.gpus_per_node:
            return self.gpus_per_node
        if self.launcher != "srun" and self.cpus_per_task:
            return self.cpus_per_task
        return 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def tasks_per_node(self) -> int:
        """Slurm tasks per node: one launcher per node, or one task per rank for srun."""
        return self.procs_per_node if self.launcher == "srun" else 1

    @property
    def alloc_tasks_per_node(self) -> int:
        """Slurm tasks per node to allocate: with ``supervise: inprocess:`` the warm standbys too."""
        inproc = (self.supervise_dict or {}).get("inprocess")
        if self.launcher != "srun" or inproc in (None, False):
            return self.tasks_per_node
        standbys = inproc.get("standbys_per_node", 1) if isinstance(inproc, dict) else 1
        return self.tasks_per_node + int(standbys)

    @property
    def alloc_nodes(self) -> int:
        """Nodes to allocate: the training's nodes plus the supervisor's spares."""
        spares = (self.supervise_dict or {}).get("spare_nodes") or 0
        return self.nodes + int(spares)

    @property
    def time_limit_s(self) -> Optional[int]:
        return None if self.time is None else parse_slurm_time(self.time)

    # -- dict round trip ------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-able dict of every key (resolved); from_dict() rebuilds the spec."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            if f.name in ("env",):
                value = dict(value)
            elif f.name == "supervise":
                value = None if value is None else dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: Optional[str] = None,
                  base_dir: Optional[str] = None) -> "JobSpec":
        """Validate a plain dict (keys as in a spec file) into a JobSpec."""
        if not isinstance(data, Mapping):
            raise InputError(f"{source or 'spec'}: a job spec must be a mapping, got {type(data).__name__}")
        locs = _Locations(source or "spec")
        return _build_spec(dict(data), locs, Path(base_dir or os.getcwd()), source)


# --------------------------------------------------------------------------------
# Slurm time formats
# --------------------------------------------------------------------------------

_TIME_FORMS = [
    (re.compile(r"(\d+)\Z"), ("m",)),
    (re.compile(r"(\d+):(\d+)\Z"), ("m", "s")),
    (re.compile(r"(\d+):(\d+):(\d+)\Z"), ("h", "m", "s")),
    (re.compile(r"(\d+)-(\d+)\Z"), ("d", "h")),
    (re.compile(r"(\d+)-(\d+):(\d+)\Z"), ("d", "h", "m")),
    (re.compile(r"(\d+)-(\d+):(\d+):(\d+)\Z"), ("d", "h", "m", "s")),
]
_UNLIMITED = ("UNLIMITED", "INFINITE")


def parse_slurm_time(text: str) -> Optional[int]:
    """Seconds for a Slurm time string; None for UNLIMITED. ValueError when malformed."""
    s = str(text).strip()
    if s.upper() in _UNLIMITED:
        return None
    for pattern, units in _TIME_FORMS:
        m = pattern.match(s)
        if not m:
            continue
        parts = dict(zip(units, (int(g) for g in m.groups())))
        # The leading field may be large ("90" minutes, "100:00:00"); the others are clock fields.
        lead = units[0]
        limits = {"h": 24, "m": 60, "s": 60}
        words = {"h": "hours", "m": "minutes", "s": "seconds"}
        for unit, value in parts.items():
            if unit != lead and unit in limits and value >= limits[unit]:
                raise ValueError(f"{words[unit]} field {value} out of range in {s!r} (at most {limits[unit] - 1})")
        seconds = (parts.get("d", 0) * 86400 + parts.get("h", 0) * 3600
                   + parts.get("m", 0) * 60 + parts.get("s", 0))
        if seconds <= 0:
            raise ValueError("a time limit of zero means no limit to Slurm; write UNLIMITED")
        return seconds
    raise ValueError(f"{s!r} is not a Slurm time (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED)")


# --------------------------------------------------------------------------------
# YAML with line numbers
# --------------------------------------------------------------------------------


class _Locations:
    """Where each key (or list item) came from: 'file:line', or '--set'."""

    def __init__(self, source: str):
        self.source = source
        self.by_path: Dict[Tuple, str] = {}

    def of(self, path: Tuple) -> str:
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path[:-1]
        return self.source

    def error(self, path: Tuple, message: str) -> InputError:
        key = ".".join(str(p) for p in path)
        where = self.of(path)
        return InputError(f"{where}: {key}: {message}" if key else f"{where}: {message}")


def _yaml():
    import yaml  # imported here: keeps `clusterops --help` light

    return yaml


_NULL_TAG = "tag:yaml.org,2002:null"


def _is_literal(path: Tuple) -> bool:
    """Scalars of text keys are taken as written (``account: 0123``, ``args: [--lr, 1e-3]``,
    ``env: {DEBUG: on}`` mean the text written): no YAML 1.1 booleans, octal or floats."""
    if not path:
        return False
    f = _FIELDS.get(path[0])
    if f is not None and f.kind == "map":
        f = _SUPERVISE.get(path[1]) if len(path) >= 2 else None
    return f is not None and _is_text(f)


def _is_text(f: schema.Field) -> bool:
    if f.kind in ("list", "dict"):
        return f.item is not None and f.item.kind in schema.TEXT_KINDS
    return f.kind in schema.TEXT_KINDS


def _scalar(node, path: Tuple, construct: Callable[[], Any]) -> Any:
    """A scalar's value: null is None, a text key's scalar is the text written, and YAML 1.1
    sexagesimal numbers (1:30:00 -> 5400) stay text: nobody means them."""
    if node.tag == _NULL_TAG and node.style is None:
        return None
    if _is_literal(path):
        return node.value
    value = construct()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and ":" in node.value:
        return node.value
    return value


def _load(node, where: str, locs: _Locations, path: Tuple = (), at: Optional[str] = None) -> Any:
    """A node tree from the one input loader (clusterops.yamlio: no anchors, aliases or merge
    keys, bounded size and depth) -> plain values, each key's place recorded in ``locs``."""
    from clusterops import yamlio

    lines: Dict[Tuple, int] = {}
    value = yamlio.to_python(node, where, lines, path, scalar=_scalar)
    for p, line in lines.items():
        locs.by_path[p] = at or f"{where}:{line}"
    return value


def parse_spec_text(text: str, source: str = "spec") -> Tuple[Dict[str, Any], _Locations]:
    """YAML text -> (plain dict, locations). Pure; raises InputError."""
    from clusterops import yamlio

    node = yamlio.compose(text, source)
    locs = _Locations(source)
    if node is None:
        raise InputError(f"{source}: empty job spec (required keys: {', '.join(REQUIRED_KEYS)})")
    yaml = _yaml()
    if not isinstance(node, yaml.MappingNode):
        raise InputError(f"{source}:{node.start_mark.line + 1}: a job spec must be a mapping of keys")
    data = _load(node, source, locs)
    return data, locs


def apply_overrides(data: Dict[str, Any], locs: _Locations, overrides: Sequence[str]) -> None:
    """Apply ``key=value`` overrides (values parsed as YAML; dotted keys reach nested maps)."""
    from clusterops import yamlio

    for item in overrides:
        if "=" not in item:
            raise InputError(f"--set {item}: expected key=value")
        key, _, text = item.partition("=")
        key = key.strip()
        path = tuple(key.split("."))
        if not key or any(not p for p in path):
            raise InputError(f"--set {item}: expected key=value")
        where = "--set"
        node = yamlio.compose(text if text.strip() else '""', where)
        value = _load(node, where, locs, path, at=where) if node is not None else None
        target = data
        for i, part in enumerate(path[:-1]):
            nxt = target.get(part)
            if nxt is None:
                nxt = target[part] = {}
            if not isinstance(nxt, dict):
                raise InputError(f"{where}: {'.'.join(path[:i + 1])} is not a mapping")
            target = nxt
        target[path[-1]] = value
        locs.by_path[path] = where


def load_spec(path: str | os.PathLike, overrides: Sequence[str] = (),
              template_dirs: Optional[Sequence[str | os.PathLike]] = None) -> JobSpec:
    """Read, override and validate a spec file. Raises InputError (exit 2).

    With ``template_dirs`` (site template directories, may be empty) the launcher is
    also checked against the templates available, so the error names the line.
    """
    p = Path(path)
    source = str(path)
    text = yamlio.read_text(p, "job spec file")   # regular files only (a FIFO never blocks), bounded
    data, locs = parse_spec_text(text, source)
    apply_overrides(data, locs, overrides)
    spec = _build_spec(data, locs, p.resolve().parent, source)
    if template_dirs is not None and spec.launcher not in LAUNCHERS:
        from clusterops.launch.templates import list_templates

        known = sorted(t["name"] for t in list_templates(template_dirs) if t["launcher"])
        if spec.launcher not in known:
            raise locs.error(("launcher",), f"unknown launcher {spec.launcher!r} (one of {', '.join(known)})"
                                            f"{schema.suggest(spec.launcher, known)}")
    return spec


# --------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------


class _Checker(schema.Checker):
    """The job spec's walk (``schema.Checker`` with the registry ``SPEC_KINDS``): values are
    checked and resolved (paths made absolute against ``base``); errors name the key path."""

    def __init__(self, data: Dict[str, Any], locs: _Locations, base: Path):
        super().__init__(SPEC_KINDS, lambda path, message: locs.error(path, message))
        self.data = data
        self.locs = locs
        self.base = base

    def err(self, path, message) -> InputError:
        return self.locs.error(path if isinstance(path, tuple) else (path,), message)

    def null(self, f: schema.Field, path: Tuple) -> bool:
        return False   # the spec's callers skip unset keys; a kind that takes null says what it means

    def present(self, key: str) -> bool:
        return self.data.get(key) is not None

    # kinds ----------------------------------------------------------------
    def text(self, path: Tuple, value: Any, *, allow_newline=False, allow_empty=False) -> str:
        if isinstance(value, (dict, list)):
            raise self.err(path, f"must be a string, got a {'mapping' if isinstance(value, dict) else 'list'}")
        if isinstance(value, bool):
            value = "true" if value else "false"
        s = str(value)
        if "\x00" in s:
            raise self.err(path, "must not contain a NUL byte")
        if not allow_newline and _CONTROL.search(s):
            raise self.err(path, f"must not contain control characters (newline, tab...), got {s!r}")
        if not allow_empty and not s.strip():
            raise self.err(path, "must not be empty")
        return s

    def integer(self, path: Tuple, value: Any, lo: Optional[float], hi: Optional[float]) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
                value = int(value)
            else:
                raise self.err(path, f"must be an integer, got {value!r}")
        lo = None if lo is None else int(lo)
        hi = None if hi is None else int(hi)
        rng = ""
        if lo is not None and hi is not None:
            rng = f"from {lo} to {hi}"
        elif lo is not None:
            rng = f">= {lo}"
        elif hi is not None:
            rng = f"<= {hi}"
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.err(path, f"must be an integer {rng}, got {value}")
        return value

    def number(self, path: Tuple, value: Any, f: schema.Field) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.err(path, f"must be a number, got {value!r}")
        if not math.isfinite(value):   # JSON (--spec-json) cannot carry it
            raise self.err(path, f"must be a finite number, got {value!r}")
        lo, hi = f.min, f.max
        if (lo is not None and (value <= lo if f.gt else value < lo)) or (hi is not None and value > hi):
            raise self.err(path, f"must be {f.range_text()}, got {value}")
        return value

    def boolean(self, path: Tuple, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.err(path, f"must be true or false, got {value!r}")
        return value

    def str_list(self, path: Tuple, value: Any, *, allow_newline: bool) -> Tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, list):
            raise self.err(path, f"must be a list, got {value!r}")
        out = []
        for i, item in enumerate(value):
            if item is None:
                raise self.err(path + (i,), "empty item (write \"\" for an empty string)")
            out.append(self.text(path + (i,), item, allow_newline=allow_newline, allow_empty=True))
        return tuple(out)

    def hostlist(self, path: Tuple, value: Any) -> str:
        if isinstance(value, list):
            value = ",".join(self.text(path + (i,), v) for i, v in enumerate(value))
        s = self.text(path, value)
        import hostlist

        try:
            names = hostlist.expand_hostlist(s)
        except hostlist.BadHostlist as e:
            raise self.err(path, f"not a valid hostlist {s!r}: {e}") from None
        if not names:
            raise self.err(path, "empty hostlist")
        return hostlist.collect_hostlist(names)

    def path(self, path: Tuple, value: Any, base: Path) -> str:
        s = self.text(path, value)
        p = Path(os.path.expanduser(s))
        if not p.is_absolute():
            p = base / p
        return os.path.normpath(str(p))

    def env(self, path: Tuple, value: Any) -> Tuple[Tuple[str, str], ...]:
        if not isinstance(value, dict):
            raise self.err(path, f"must be a mapping of NAME: value, got {value!r}")
        pairs = []
        for k, v in value.items():
            if not _ENV_NAME.match(str(k)):
                raise self.err(path + (k,), "not a valid environment variable name")
            if v is None:
                raise self.err(path + (k,), "no value (write \"\" for an empty string)")
            pairs.append((str(k), self.text(path + (k,), v, allow_newline=True, allow_empty=True)))
        return tuple(pairs)

    def lines(self, path: Tuple, value: Any) -> Tuple[str, ...]:
        if isinstance(value, str):
            lines = tuple(value.splitlines())
        else:
            items = self.str_list(path, value, allow_newline=True)
            lines = tuple(line for item in items for line in (item.splitlines() or [""]))
        if any("\x00" in ln for ln in lines):
            raise self.err(path, "must not contain a NUL byte")
        return lines


def _k_time(c: _Checker, value: Any, f: schema.Field, path: Tuple) -> str:
    t = c.text(path, value).strip()
    try:
        parse_slurm_time(t)
    except ValueError as e:
        raise c.err(path, str(e)) from None
    return t


def _k_mem(c: _Checker, value: Any, f: schema.Field, path: Tuple) -> str:
    mem = c.text(path, value)
    if not _MEM.match(mem):
        raise c.err(path, f"must be a size like 200G, 64000M or 0, got {mem!r}")
    return mem.upper()


def _k_map(c: _Checker, value: Any, f: schema.Field, path: Tuple) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise c.err(path, f"must be a mapping, got {value!r}")
    keys = {x.name: x for x in f.fields}
    for key in value:
        if key not in keys:
            raise c.err(path + (key,), f"unknown key{schema.suggest(str(key), keys)}")
    out = {}
    for x in f.fields:
        if value.get(x.name) is not None:
            out[x.name] = c.check(value[x.name], x, path + (x.name,))
        elif x.required:
            raise c.err(path, f"{x.name}: required")
    return out


def _k_regex(c: _Checker, value: Any, f: schema.Field, path: Tuple) -> str:
    text = c.text(path, value)
    try:
        rx = re.compile(text)
    except re.error as e:
        raise c.err(path, f"not a valid regular expression: {e}") from None
    if rx.groups < 1:
        raise c.err(path, "needs a group for the step, e.g. 'step[= ](\\d+)'")
    return text


def _k_profile(c: _Checker, value: Any, f: schema.Field, path: Tuple) -> Any:
    if value is False or value is None:
        return False
    if value is True:
        raise c.err(path, "name a health profile (e.g. preflight, fast, deep) or write false")
    return c.text(path, value)


#: The job spec's kinds: the schema's registry, extended by the spec's own kinds (path,
#: hostlist, time, mem, lines, text) and with the scalar kinds read as a YAML spec writes them
#: (``nodes: "4"`` is 4, text keys keep what was written, errors say "an integer from 1 to N").
SPEC_KINDS: Dict[str, schema.KindCheck] = {
    **schema.KINDS,
    "str": lambda c, v, f, path: c.text(path, v),
    "text": lambda c, v, f, path: c.text(path, v, allow_newline=True, allow_empty=True),   # may span lines
    "int": lambda c, v, f, path: c.integer(path, v, f.min, f.max),
    "number": lambda c, v, f, path: c.number(path, v, f),
    "bool": lambda c, v, f, path: c.boolean(path, v),
    "path": lambda c, v, f, path: c.path(path, v, c.base),
    "hostlist": lambda c, v, f, path: c.hostlist(path, v),
    "list": lambda c, v, f, path: c.str_list(path, v, allow_newline=f.item is not None and f.item.kind == "text"),
    "time": _k_time,
    "mem": _k_mem,
    "dict": lambda c, v, f, path: c.env(path, v),
    "lines": lambda c, v, f, path: c.lines(path, v),
    "map": _k_map,
    "regex": _k_regex,
    "profile": _k_profile,
}


def _build_spec(data: Dict[str, Any], locs: _Locations, base_dir: Path, source: Optional[str]) -> JobSpec:
    c = _Checker(data, locs, base_dir)
    for key in data:
        if key not in _FIELDS:
            raise c.err((key,), f"unknown key{schema.suggest(key, _FIELDS)}")
    missing = [k for k in REQUIRED_KEYS if data.get(k) is None]
    if missing:
        raise InputError(f"{locs.source}: {missing[0]}: required key missing "
                         f"(required: {', '.join(REQUIRED_KEYS)})")
    kw: Dict[str, Any] = {"source": source}

    # Paths are relative to workdir, which is relative to the spec file's directory.
    workdir = Path(c.path(("workdir",), data["workdir"], base_dir)) if c.present("workdir") else base_dir
    kw["workdir"] = os.path.normpath(str(workdir))
    c.base = workdir
    for f in schema.JOB_SPEC.fields:
        if f.name not in ("workdir", "supervise") and c.present(f.name):
            kw[f.name] = c.check(data[f.name], f, (f.name,))

    # The rules that go beyond one key's kind and bounds.
    name = kw["name"]
    # The name is %x in the log file names: Slurm would read a '/' as a directory, and
    # a '%' or '\\' in the expanded name stops it from expanding the per-node %N/%n.
    bad = sorted(set(name) & set("/%\\"))
    if bad:
        raise c.err("name", f"must not contain {' or '.join(repr(b) for b in bad)} "
                            f"(Slurm uses it in log file names), got {name!r}")
    launcher = kw["launcher"]
    if launcher not in LAUNCHERS and not re.fullmatch(r"[A-Za-z0-9_-]+", launcher):
        raise c.err("launcher", f"unknown launcher {launcher!r} (one of {', '.join(LAUNCHERS)})")
    # (a site template may add launchers: checked at render time)

    kw.setdefault("log_dir", os.path.join(kw["workdir"], "logs"))
    for key in ("workdir", "log_dir"):
        if kw[key] != kw[key].strip():
            raise c.err(key, f"must not start or end with white space, got {kw[key]!r}")
    bad = sorted(set(kw["log_dir"]) & set("%\\"))
    if bad:
        raise c.err("log_dir", f"must not contain {' or '.join(repr(b) for b in bad)} (Slurm's log file "
                               f"patterns would misread it), got {kw['log_dir']!r}")

    script = kw["script"]
    if "container_image" not in kw:
        # On a cluster the submit host sees the same shared file system as the nodes.
        sp = Path(script)
        if not sp.exists():
            raise c.err("script", f"{script}: no such file")
        if sp.is_dir():
            raise c.err("script", f"{script}: is a directory, not a script")
        if not os.access(sp, os.R_OK):
            raise c.err("script", f"{script}: not readable")
        if launcher == "srun" and not script.endswith(".py") and not os.access(sp, os.X_OK):
            raise c.err("script", f"{script}: not executable (the srun launcher runs non-.py scripts directly)")

    for i, url in enumerate(kw.get("notify", ())):
        from clusterops.notify import url_problem   # the one webhook URL rule (a bad port too)

        why = url_problem(url)
        if why is not None:
            raise c.err(("notify", i), why)
    for i, a in enumerate(kw.get("sbatch_args", ())):
        if not a.startswith("--") or len(a) < 3:
            raise c.err(("sbatch_args", i), f"each item must be one long option like --mail-type=END, got {a!r}")

    time_limit_s = parse_slurm_time(kw["time"]) if "time" in kw else None
    if "signal_lead_s" in kw:
        lead = kw["signal_lead_s"]
        if time_limit_s is not None and lead >= time_limit_s:
            raise c.err("signal_lead_s", f"{lead} s is not shorter than the time limit "
                                         f"{kw['time']} ({time_limit_s} s)")
    else:
        lead = DEFAULT_SIGNAL_LEAD_S
        if time_limit_s is not None:
            lead = min(lead, time_limit_s // 2)
    kw["signal_lead_s"] = lead

    supervise = None
    if "supervise" in data and data["supervise"] is not None and data["supervise"] is not False:
        supervise = _build_supervise(c, data["supervise"], kw, workdir)
        kw["supervise"] = tuple(supervise.items())
        given = data["supervise"] if isinstance(data["supervise"], dict) else {}
        if kw.get("chain", 1) > 1 and given.get("ckpt_dir") in (None, ""):
            # Each generation resumes from this directory; the default (<workdir>/checkpoints)
            # is every run's of that workdir, and a chain must not resume another run's.
            raise c.err("chain", f"a chain of {kw['chain']} generations resumes each one from its checkpoint "
                                 "directory: set supervise.ckpt_dir (one directory for this run)")
    if "requeue" not in kw:
        # The supervisor requeues the job itself (time limit, preemption): Slurm must allow it.
        kw["requeue"] = supervise is not None
    if kw.get("segment"):
        alloc = kw["nodes"] + int((supervise or {}).get("spare_nodes") or 0)
        if alloc % kw["segment"]:
            raise c.err("segment", f"{kw['segment']} does not divide the job's {alloc} node(s) "
                                   f"(nodes + supervise.spare_nodes): Slurm allocates whole segments")
    problem = exec_limit_problem(kw)
    if problem:
        raise c.err(*problem)
    return JobSpec(**kw)


# --------------------------------------------------------------------------------
# The kernel's limits on what one program start can carry
# --------------------------------------------------------------------------------

#: Linux: one argument or environment string, with its NUL, is at most 32 pages
#: (MAX_ARG_STRLEN); a longer one fails execve with E2BIG, whatever the stack limit.
MAX_ARG_STRLEN = 32 * 4096
#: What the job's programs get besides the spec's own values: Slurm's SLURM_* variables,
#: the shell's, the supervisor's CLUSTEROPS_* and rank variables, srun's own options.
ARG_RESERVE_BYTES = 128 << 10
_POINTER_BYTES = 8


def arg_max_bytes() -> int:
    """The kernel's limit on argv + envp of one execve (ARG_MAX: RLIMIT_STACK / 4, often 2 MiB)."""
    try:
        n = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        n = -1
    return n if n and n > 0 else 2 << 20


def _exec_strings(kw: Mapping[str, Any]):
    """((key path), bytes with NUL) of every spec value that is one argv or envp string of
    the training command (srun's and the ranks'), in spec order."""
    for key in ("python", "script"):
        if kw.get(key):
            yield (key,), len(str(kw[key]).encode()) + 1
    for key in ("args", "launcher_args", "srun_args"):
        for i, a in enumerate(kw.get(key) or ()):
            yield (key, i), len(str(a).encode()) + 1
    for i, a in enumerate(dict(kw.get("supervise") or ()).get("resume_args") or ()):
        yield ("supervise", "resume_args", i), len(str(a).encode()) + 1 + 4096   # {ckpt}: a path
    for name, value in kw.get("env") or ():
        yield ("env", name), len(f"{name}={value}".encode()) + 1


def exec_limit_problem(kw: Mapping[str, Any], *, arg_max: Optional[int] = None) -> Optional[Tuple[Tuple, str]]:
    """(key path, message) when the job's command could not start: one argument or
    environment string over MAX_ARG_STRLEN, or all of them over ARG_MAX less
    ARG_RESERVE_BYTES; else None. ``kw``: spec keys as JobSpec fields hold them."""
    arg_max = arg_max_bytes() if arg_max is None else arg_max
    items = list(_exec_strings(kw))
    for path, size in items:
        if size > MAX_ARG_STRLEN:
            what = "environment string NAME=value" if path[0] == "env" else "argument"
            return path, (f"{size - 1} bytes: one {what} is limited to {MAX_ARG_STRLEN - 1} bytes by the "
                          f"kernel (MAX_ARG_STRLEN), so the job's command could not start (E2BIG); pass "
                          f"large values in a file")
    total = sum(size + _POINTER_BYTES for _, size in items)
    limit = arg_max - ARG_RESERVE_BYTES
    if total > limit:
        path, size = max(items, key=lambda item: item[1])
        largest = ".".join(str(p) for p in path)
        return path, (f"the arguments and environment of the job's command total {total} bytes, over the "
                      f"kernel's limit of {arg_max} (ARG_MAX) less {ARG_RESERVE_BYTES} for what Slurm and "
                      f"clusterops add, so it could not start (E2BIG); the largest is {largest} "
                      f"({size - 1} bytes): pass large values in a file")
    return None


def _build_supervise(c: _Checker, value: Any, kw: Dict[str, Any], workdir: Path) -> Dict[str, Any]:
    """The ``supervise:`` mapping, checked by the table: only what the user set (the defaults
    live in the supervisor's Policy), plus ``ckpt_dir`` resolved against workdir."""
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise c.err("supervise", f"must be a mapping of supervisor settings, got {value!r}")
    for key in value:
        if key not in _SUPERVISE:
            raise c.err(("supervise", key), f"unknown key{schema.suggest(str(key), _SUPERVISE)}")
    out: Dict[str, Any] = {"ckpt_dir": os.path.join(str(workdir), "checkpoints")}
    for f in schema.SUPERVISE.fields:
        if f.name == "min_nodes":   # continue on fewer nodes: at most the nodes there are
            f = dataclasses.replace(f, max=kw["nodes"])
        # A profile's null means off; any other null means "the default".
        if f.name in value and (value[f.name] is not None or f.kind == "profile"):
            out[f.name] = c.check(value[f.name], f, ("supervise", f.name))

    def p(key):
        return ("supervise", key)

    if out.get("job_dir_mode", "0700") not in schema.JOB_DIR_MODES:
        raise c.err(p("job_dir_mode"), f"must be one of {', '.join(schema.JOB_DIR_MODES)}, "
                                       f"got {out['job_dir_mode']!r}")
    lead = kw.get("signal_lead_s", DEFAULT_SIGNAL_LEAD_S)
    stop = out.get("stop_timeout_s")
    if lead and stop is not None and stop >= lead:
        raise c.err(p("stop_timeout_s"), f"{stop:g} s leaves no time before the limit: it must be shorter "
                                         f"than signal_lead_s ({lead} s)")
    return out
