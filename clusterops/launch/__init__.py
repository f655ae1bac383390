"""Job specs (YAML) -> validated JobSpec -> rendered sbatch script -> submitted job.

Three steps, kept apart (render first, submit second):

* ``load_spec(path, overrides)`` reads the YAML, validates every key and returns a
  :class:`JobSpec`. Errors are one line naming the file, the line and the key
  (``job.yaml:7: nodes: must be an integer >= 1, got 0``); unknown keys suggest
  the closest valid one. ``--set key=value`` overrides use the same rules.
* ``render(spec, template_dirs)`` is pure: spec in, script text out. Templates are
  Jinja2 files searched in site directories first, then in the built-in
  ``clusterops.templates`` package; every value that reaches the shell goes through
  a quoting filter.
* ``submit(spec, slurm)`` renders, writes the script next to the logs and calls
  ``Slurm.submit``; the only side effect.

Paths in a spec file are relative to the directory of that file (``workdir``
defaults to it); the resolved spec holds absolute paths, so ``to_dict()`` /
``from_dict()`` round-trip it exactly (the supervisor rebuilds the spec that way).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import shlex
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from clusterops.errors import ClusteropsError, InputError

LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "srun")
TEMPLATE_SUFFIX = ".sh.j2"
BASE_TEMPLATE = "base" + TEMPLATE_SUFFIX
TEMPLATES_ENV = "CLUSTEROPS_TEMPLATES"
DEFAULT_SIGNAL_LEAD_S = 600
MAX_SIGNAL_LEAD_S = 65535  # Slurm's --signal=...@<sec> upper bound
MAX_CHAIN = 1000

REQUIRED_KEYS = ("name", "nodes", "launcher", "script")

# key -> one-line description (the documented key table; docs/launch.md mirrors it).
KEY_DOCS: Dict[str, str] = {
    "name": "job name (--job-name); no control characters or '/'",
    "nodes": "number of nodes the training runs on (>= 1)",
    "launcher": "torchrun | accelerate | deepspeed | srun (or a site template's name)",
    "script": "training script; relative to workdir; must be readable (unless container_image)",
    "args": "list of arguments for the script, passed literally",
    "env": "mapping of environment variables exported (quoted) before setup",
    "gpus_per_node": "GPUs per node (--gpus-per-node); 0 = none (default 0)",
    "nproc_per_node": "processes (ranks) per node; default gpus_per_node, else cpus_per_task for "
                      "torchrun/accelerate/deepspeed (one per CPU), else 1",
    "cpus_per_task": "CPUs per task (--cpus-per-task); one task per node except for the srun launcher",
    "mem": "memory per node (--mem), e.g. 200G; 0 = all of it",
    "time": "time limit in a Slurm format: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, UNLIMITED",
    "partition": "partition (--partition)",
    "account": "account (--account)",
    "qos": "quality of service (--qos)",
    "exclusive": "whole nodes (--exclusive); default false",
    "exclude": "nodes never to use (--exclude), a hostlist",
    "nodelist": "nodes to use (--nodelist), a hostlist",
    "constraint": "node features (--constraint)",
    "workdir": "working directory of the job (--chdir); default: the spec file's directory",
    "log_dir": "where the batch log, per-node logs and the rendered script go; default <workdir>/logs",
    "container_image": "pyxis/enroot image for srun --container-image",
    "container_mounts": "pyxis --container-mounts value",
    "setup": "shell lines run in the batch shell before the launch (module load, venv activation); verbatim",
    "signal_lead_s": "seconds before the time limit to send SIGUSR1 (--signal=B:USR1@N), forwarded to "
                     "the training processes; 0 = off; default 600 (at most half the time limit)",
    "requeue": "let Slurm requeue the job (--requeue / --no-requeue); default false, true with supervise",
    "chain": "run as a chain of N jobs, one after the other (--array=1-N%1); default 1",
    "master_port": "fixed rendezvous port; default: derived from the job id (10000-29999), probed free",
    "srun_wait_s": "srun --wait: seconds to wait for the other tasks once one has ended (default 60)",
    "python": "interpreter for .py scripts under the srun launcher (default python3)",
    "launcher_args": "extra arguments for the launcher (torchrun/accelerate/deepspeed), before the script",
    "srun_args": "extra srun arguments for the training step",
    "sbatch_args": "extra #SBATCH lines, each one option starting with --",
    "supervise": "run under `clusterops supervise` (self-healing); a mapping, see the supervise keys",
}

SUPERVISE_DOCS: Dict[str, str] = {
    "ckpt_dir": "checkpoint root (CLUSTEROPS_CKPT_DIR); relative to workdir; default <workdir>/checkpoints",
    "hang_timeout_s": "no heartbeat progress from a rank for this long is a hang (> 0; default 300)",
    "max_restarts": "restarts inside the allocation before requeueing or giving up (>= 0; default 5)",
    "max_requeues": "requeues (SLURM_RESTART_COUNT) before giving up (>= 0; default 3)",
    "no_progress_restarts": "restarts in a row without a newer checkpoint before giving up (>= 1; default 3)",
    "spare_nodes": "extra nodes allocated to replace bad ones (>= 0; default 0)",
    "min_nodes": "continue on fewer nodes down to this many (1..nodes; default nodes)",
    "preflight": "health profile run on every node before the launch, or false (default preflight)",
    "drain_bad_nodes": "drain nodes judged bad, with a clusterops: reason (default false)",
    "stop_timeout_s": "seconds the ranks get to checkpoint and stop (> 0, < signal_lead_s; default 120)",
    "job_dir": "the supervisor's timeline and state; relative to workdir; default <log_dir>/<name>-<job id>",
    # Finer supervisor settings (see `clusterops supervise --help`).
    "startup_timeout_s": "time a rank gets to its first heartbeat (> 0; default 600)",
    "kill_timeout_s": "time a killed step gets to go away before escalation (> 0; default 30)",
    "preflight_timeout_s": "time limit of the preflight check (> 0; default 180)",
    "postmortem": "health profile run on blamed nodes after a failure, or false (default off)",
    "node_fail_threshold": "failures blamed on one node before it is dropped (>= 1; default 2)",
    "verify_deep": "hash-check the checkpoint to resume from, not only sizes (default true)",
    "step_wait_s": "srun --wait for the supervisor's training steps (> 0)",
    "liveness_check": "after a failure without a postmortem profile, check every node still answers (default true)",
    "liveness_timeout_s": "time limit of that liveness check (> 0; default 10)",
    "hang_blame_margin_s": "blame a hung rank only when it fell silent this long before the others (>= 0; default 5)",
}
# Defaults live in the supervisor (clusterops.supervisor.Policy); a resolved spec
# carries only what the user set, plus ckpt_dir resolved against workdir.

# Keys whose YAML scalars are taken as written (no 1.1 booleans, octal, floats):
# `account: 0123`, `args: [--lr, 1e-3]`, `env: {DEBUG: on}` mean the text written.
_LITERAL_KEYS = {
    "name", "launcher", "script", "args", "env", "mem", "time", "partition", "account", "qos",
    "exclude", "nodelist", "constraint", "workdir", "log_dir", "container_image",
    "container_mounts", "setup", "python", "launcher_args", "srun_args", "sbatch_args",
}
_LITERAL_SUPERVISE = {"ckpt_dir", "job_dir"}

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
    workdir: str = ""
    log_dir: str = ""
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    setup: Tuple[str, ...] = ()
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    requeue: bool = False
    chain: int = 1
    master_port: Optional[int] = None
    srun_wait_s: int = 60
    python: str = "python3"
    launcher_args: Tuple[str, ...] = ()
    srun_args: Tuple[str, ...] = ()
    sbatch_args: Tuple[str, ...] = ()
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


def spec_keys() -> List[str]:
    return list(KEY_DOCS)


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
    if not path:
        return False
    if path[0] == "supervise":
        return len(path) >= 2 and path[1] in _LITERAL_SUPERVISE
    return path[0] in _LITERAL_KEYS


def _walk(node, path: Tuple, loader, locs: _Locations, line_of: Callable[[Any], str]) -> Any:
    """YAML node -> plain value, recording each mapping key's location."""
    yaml = _yaml()
    if isinstance(node, yaml.MappingNode):
        out: Dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise InputError(f"{line_of(key_node)}: {'.'.join(map(str, path)) or 'spec'}: "
                                 f"keys must be plain names")
            key = key_node.value
            if key == "<<":
                raise InputError(f"{line_of(key_node)}: YAML merge keys (<<) are not supported in job specs")
            if key in out:
                raise InputError(f"{line_of(key_node)}: {'.'.join(map(str, path + (key,)))}: "
                                 f"duplicate key (first given at {locs.by_path.get(path + (key,))})")
            locs.by_path[path + (key,)] = line_of(key_node)
            out[key] = _walk(value_node, path + (key,), loader, locs, line_of)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            locs.by_path[path + (i,)] = line_of(item)
            items.append(_walk(item, path + (i,), loader, locs, line_of))
        return items
    # Scalar
    if node.tag == _NULL_TAG and node.style is None:
        return None
    if _is_literal(path):
        return node.value
    value = loader.construct_object(node, deep=True)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and ":" in node.value:
        # YAML 1.1 sexagesimal (1:30:00 -> 5400): nobody means that; keep the text.
        return node.value
    return value


def _compose(text: str, where: str):
    """YAML text -> (node tree, a loader to construct scalars) through the one input loader
    (clusterops.yamlio): no anchors/aliases/merge keys, bounded size and depth."""
    from clusterops import yamlio

    node = yamlio.compose(text, where)
    return node, yamlio.scalar_loader(where)


def parse_spec_text(text: str, source: str = "spec") -> Tuple[Dict[str, Any], _Locations]:
    """YAML text -> (plain dict, locations). Pure; raises InputError."""
    node, loader = _compose(text, source)
    locs = _Locations(source)
    if node is None:
        raise InputError(f"{source}: empty job spec (required keys: {', '.join(REQUIRED_KEYS)})")
    yaml = _yaml()
    if not isinstance(node, yaml.MappingNode):
        raise InputError(f"{source}:{node.start_mark.line + 1}: a job spec must be a mapping of keys")
    data = _walk(node, (), loader, locs, lambda n: f"{source}:{n.start_mark.line + 1}")
    return data, locs


def apply_overrides(data: Dict[str, Any], locs: _Locations, overrides: Sequence[str]) -> None:
    """Apply ``key=value`` overrides (values parsed as YAML; dotted keys reach nested maps)."""
    for item in overrides:
        if "=" not in item:
            raise InputError(f"--set {item}: expected key=value")
        key, _, text = item.partition("=")
        key = key.strip()
        path = tuple(key.split("."))
        if not key or any(not p for p in path):
            raise InputError(f"--set {item}: expected key=value")
        where = "--set"
        node, loader = _compose(text if text.strip() else '""', where)
        value = _walk(node, path, loader, locs, lambda n: where) if node is not None else None
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
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InputError(f"{source}: no such job spec file") from None
    except IsADirectoryError:
        raise InputError(f"{source}: is a directory, not a job spec file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{source}: cannot read job spec: {getattr(e, 'strerror', None) or e}") from None
    data, locs = parse_spec_text(text, source)
    apply_overrides(data, locs, overrides)
    spec = _build_spec(data, locs, p.resolve().parent, source)
    if template_dirs is not None and spec.launcher not in LAUNCHERS:
        known = sorted(t["name"] for t in list_templates(template_dirs) if t["launcher"])
        if spec.launcher not in known:
            raise locs.error(("launcher",), f"unknown launcher {spec.launcher!r} (one of {', '.join(known)})"
                                            f"{_suggest(spec.launcher, known)}")
    return spec


# --------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------


def _suggest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Checker:
    def __init__(self, data: Dict[str, Any], locs: _Locations):
        self.data = data
        self.locs = locs

    def err(self, path, message) -> InputError:
        return self.locs.error(path if isinstance(path, tuple) else (path,), message)

    def present(self, key: str) -> bool:
        return self.data.get(key) is not None

    # scalar kinds ---------------------------------------------------------
    def text(self, key: str, value: Any, path=None, *, allow_newline=False, allow_empty=False) -> str:
        path = path or (key,)
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

    def integer(self, key: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None, path=None) -> int:
        path = path or (key,)
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
                value = int(value)
            else:
                raise self.err(path, f"must be an integer, got {value!r}")
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

    def number(self, key: str, value: Any, *, positive=True, path=None) -> float:
        path = path or (key,)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.err(path, f"must be a number, got {value!r}")
        if positive and not value > 0:
            raise self.err(path, f"must be > 0, got {value}")
        return value

    def boolean(self, key: str, value: Any, path=None) -> bool:
        if not isinstance(value, bool):
            raise self.err(path or (key,), f"must be true or false, got {value!r}")
        return value

    def str_list(self, key: str, value: Any, *, allow_newline: bool) -> Tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, list):
            raise self.err((key,), f"must be a list, got {value!r}")
        out = []
        for i, item in enumerate(value):
            if item is None:
                raise self.err((key, i), "empty item (write \"\" for an empty string)")
            out.append(self.text(key, item, (key, i), allow_newline=allow_newline, allow_empty=True))
        return tuple(out)

    def hostlist(self, key: str, value: Any) -> str:
        if isinstance(value, list):
            value = ",".join(self.text(key, v, (key, i)) for i, v in enumerate(value))
        s = self.text(key, value)
        import hostlist

        try:
            names = hostlist.expand_hostlist(s)
        except hostlist.BadHostlist as e:
            raise self.err((key,), f"not a valid hostlist {s!r}: {e}") from None
        if not names:
            raise self.err((key,), "empty hostlist")
        return hostlist.collect_hostlist(names)

    def path(self, key: str, value: Any, base: Path, path=None) -> str:
        s = self.text(key, value, path)
        p = Path(os.path.expanduser(s))
        if not p.is_absolute():
            p = base / p
        return os.path.normpath(str(p))


def _build_spec(data: Dict[str, Any], locs: _Locations, base_dir: Path, source: Optional[str]) -> JobSpec:
    c = _Checker(data, locs)
    for key in data:
        if key not in KEY_DOCS:
            raise c.err((key,), f"unknown key{_suggest(key, KEY_DOCS)}")
    missing = [k for k in REQUIRED_KEYS if data.get(k) is None]
    if missing:
        raise InputError(f"{locs.source}: {missing[0]}: required key missing "
                         f"(required: {', '.join(REQUIRED_KEYS)})")
    kw: Dict[str, Any] = {"source": source}

    name = c.text("name", data["name"])
    # The name is %x in the log file names: Slurm would read a '/' as a directory, and
    # a '%' or '\\' in the expanded name stops it from expanding the per-node %N/%n.
    bad = sorted(set(name) & set("/%\\"))
    if bad:
        raise c.err("name", f"must not contain {' or '.join(repr(b) for b in bad)} "
                            f"(Slurm uses it in log file names), got {name!r}")
    kw["name"] = name
    kw["nodes"] = c.integer("nodes", data["nodes"], 1, 100000)

    launcher = c.text("launcher", data["launcher"])
    if launcher not in LAUNCHERS and not re.fullmatch(r"[A-Za-z0-9_-]+", launcher):
        raise c.err("launcher", f"unknown launcher {launcher!r} (one of {', '.join(LAUNCHERS)})")
    kw["launcher"] = launcher  # a site template may add launchers: checked at render time

    for key in ("gpus_per_node",):
        if c.present(key):
            kw[key] = c.integer(key, data[key], 0, 1024)
    for key in ("nproc_per_node", "cpus_per_task"):
        if c.present(key):
            kw[key] = c.integer(key, data[key], 1, 4096)
    if c.present("mem"):
        mem = c.text("mem", data["mem"])
        if not _MEM.match(mem):
            raise c.err("mem", f"must be a size like 200G, 64000M or 0, got {mem!r}")
        kw["mem"] = mem.upper()
    time_limit_s: Optional[int] = None
    if c.present("time"):
        t = c.text("time", data["time"]).strip()
        try:
            time_limit_s = parse_slurm_time(t)
        except ValueError as e:
            raise c.err("time", str(e)) from None
        kw["time"] = t
    for key in ("partition", "account", "qos", "constraint", "container_image", "container_mounts"):
        if c.present(key):
            kw[key] = c.text(key, data[key])
    if c.present("python"):
        kw["python"] = c.text("python", data["python"])
    for key in ("exclude", "nodelist"):
        if c.present(key):
            kw[key] = c.hostlist(key, data[key])
    if c.present("exclusive"):
        kw["exclusive"] = c.boolean("exclusive", data["exclusive"])

    workdir = Path(c.path("workdir", data["workdir"], base_dir)) if c.present("workdir") else base_dir
    kw["workdir"] = os.path.normpath(str(workdir))
    kw["log_dir"] = c.path("log_dir", data["log_dir"], workdir) if c.present("log_dir") \
        else os.path.join(kw["workdir"], "logs")
    for key in ("workdir", "log_dir"):
        if kw[key] != kw[key].strip():
            raise c.err(key, f"must not start or end with white space, got {kw[key]!r}")
    bad = sorted(set(kw["log_dir"]) & set("%\\"))
    if bad:
        raise c.err("log_dir", f"must not contain {' or '.join(repr(b) for b in bad)} (Slurm's log file "
                               f"patterns would misread it), got {kw['log_dir']!r}")

    script = c.path("script", data["script"], workdir)
    if not c.present("container_image"):
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
    kw["script"] = script

    if c.present("args"):
        kw["args"] = c.str_list("args", data["args"], allow_newline=True)
    for key in ("launcher_args", "srun_args"):
        if c.present(key):
            kw[key] = c.str_list(key, data[key], allow_newline=False)
    if c.present("sbatch_args"):
        sb = c.str_list("sbatch_args", data["sbatch_args"], allow_newline=False)
        for i, a in enumerate(sb):
            if not a.startswith("--") or len(a) < 3:
                raise c.err(("sbatch_args", i), f"each item must be one long option like --mail-type=END, got {a!r}")
        kw["sbatch_args"] = sb

    if c.present("env"):
        env = data["env"]
        if not isinstance(env, dict):
            raise c.err("env", f"must be a mapping of NAME: value, got {env!r}")
        pairs = []
        for k, v in env.items():
            if not _ENV_NAME.match(str(k)):
                raise c.err(("env", k), "not a valid environment variable name")
            if v is None:
                raise c.err(("env", k), "no value (write \"\" for an empty string)")
            pairs.append((str(k), c.text("env", v, ("env", k), allow_newline=True, allow_empty=True)))
        kw["env"] = tuple(pairs)

    if c.present("setup"):
        setup = data["setup"]
        if isinstance(setup, str):
            lines = tuple(setup.splitlines())
        else:
            lines = c.str_list("setup", setup, allow_newline=True)
            lines = tuple(line for item in lines for line in (item.splitlines() or [""]))
        if any("\x00" in ln for ln in lines):
            raise c.err("setup", "must not contain a NUL byte")
        kw["setup"] = lines

    if c.present("chain"):
        kw["chain"] = c.integer("chain", data["chain"], 1, MAX_CHAIN)
    if c.present("master_port"):
        kw["master_port"] = c.integer("master_port", data["master_port"], 1024, 65535)
    if c.present("srun_wait_s"):
        kw["srun_wait_s"] = c.integer("srun_wait_s", data["srun_wait_s"], 0, 86400)

    if c.present("signal_lead_s"):
        lead = c.integer("signal_lead_s", data["signal_lead_s"], 0, MAX_SIGNAL_LEAD_S)
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

    if c.present("requeue"):
        kw["requeue"] = c.boolean("requeue", data["requeue"])
    else:
        # The supervisor requeues the job itself (time limit, preemption): Slurm must allow it.
        kw["requeue"] = supervise is not None

    return JobSpec(**kw)


def _build_supervise(c: _Checker, value: Any, kw: Dict[str, Any], workdir: Path) -> Dict[str, Any]:
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise c.err("supervise", f"must be a mapping of supervisor settings, got {value!r}")
    for key in value:
        if key not in SUPERVISE_DOCS:
            raise c.err(("supervise", key), f"unknown key{_suggest(str(key), SUPERVISE_DOCS)}")
    given = {k: v for k, v in value.items() if v is not None}
    out: Dict[str, Any] = {}

    def p(key):
        return ("supervise", key)

    out["ckpt_dir"] = (c.path("supervise", given["ckpt_dir"], workdir, p("ckpt_dir")) if "ckpt_dir" in given
                       else os.path.join(str(workdir), "checkpoints"))
    if "job_dir" in given:
        out["job_dir"] = c.path("supervise", given["job_dir"], workdir, p("job_dir"))
    for key in ("hang_timeout_s", "stop_timeout_s", "startup_timeout_s", "kill_timeout_s",
                "preflight_timeout_s", "step_wait_s", "liveness_timeout_s"):
        if key in given:
            out[key] = c.number("supervise", given[key], path=p(key))
    if "hang_blame_margin_s" in given:
        margin = c.number("supervise", given["hang_blame_margin_s"], positive=False, path=p("hang_blame_margin_s"))
        if margin < 0:
            raise c.err(p("hang_blame_margin_s"), f"must be >= 0, got {margin}")
        out["hang_blame_margin_s"] = margin
    for key, lo in (("max_restarts", 0), ("max_requeues", 0), ("no_progress_restarts", 1), ("spare_nodes", 0),
                    ("node_fail_threshold", 1)):
        if key in given:
            out[key] = c.integer("supervise", given[key], lo, 100000, path=p(key))
    if "min_nodes" in given:
        out["min_nodes"] = c.integer("supervise", given["min_nodes"], 1, kw["nodes"], path=p("min_nodes"))
    for key in ("drain_bad_nodes", "verify_deep", "liveness_check"):
        if key in given:
            out[key] = c.boolean("supervise", given[key], path=p(key))
    for key in ("preflight", "postmortem"):
        if key in value:
            profile = value[key]
            if profile is False or profile is None:
                out[key] = False
            elif profile is True:
                raise c.err(p(key), "name a health profile (e.g. preflight, fast, deep) or write false")
            else:
                out[key] = c.text("supervise", profile, p(key))
    lead = kw.get("signal_lead_s", DEFAULT_SIGNAL_LEAD_S)
    stop = out.get("stop_timeout_s")
    if lead and stop is not None and stop >= lead:
        raise c.err(p("stop_timeout_s"), f"{stop:g} s leaves no time before the limit: it must be shorter "
                                         f"than signal_lead_s ({lead} s)")
    return out


# --------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------


def builtin_template_dir() -> Path:
    from clusterops.resources import data_dir

    return data_dir("templates")


def template_search_path(site_dirs: Sequence[str | os.PathLike] = (), *,
                         environ: Optional[Mapping[str, str]] = None) -> List[Tuple[Path, str]]:
    """Directories searched for templates, first match wins: [(dir, origin)].

    Order: ``--templates`` directories, then ``$CLUSTEROPS_TEMPLATES`` (os.pathsep
    separated), then the built-in templates.
    """
    environ = os.environ if environ is None else environ
    dirs: List[Tuple[Path, str]] = []
    for d in site_dirs:
        dirs.append((Path(d), "--templates"))
    for d in (environ.get(TEMPLATES_ENV) or "").split(os.pathsep):
        if d.strip():
            dirs.append((Path(d), TEMPLATES_ENV))
    for d, origin in dirs:
        if not d.is_dir():
            raise InputError(f"{origin} {d}: no such templates directory")
    dirs.append((builtin_template_dir(), "built-in"))
    return dirs


def list_templates(site_dirs: Sequence[str | os.PathLike] = (), *,
                   environ: Optional[Mapping[str, str]] = None) -> List[Dict[str, Any]]:
    """Every template name, where it is used from, and what it shadows."""
    seen: Dict[str, Dict[str, Any]] = {}
    for d, origin in template_search_path(site_dirs, environ=environ):
        for p in sorted(d.glob("*" + TEMPLATE_SUFFIX)):
            name = p.name[: -len(TEMPLATE_SUFFIX)]
            if name in seen:
                seen[name]["shadows"].append(str(p))
            else:
                seen[name] = {"name": name, "path": str(p), "origin": origin, "shadows": [],
                              "launcher": name != "base"}
    return sorted(seen.values(), key=lambda t: (t["name"] != "base", t["name"]))


def shell_quote(value: Any) -> str:
    """Quote one value for bash (single quotes; safe for every byte but NUL)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    s = str(value)
    if "\x00" in s:
        raise ValueError("a NUL byte cannot be passed to a program")
    return shlex.quote(s)


def sbatch_quote(value: Any) -> str:
    """Quote a value for an ``#SBATCH`` line.

    sbatch reads directives with its own small parser, not bash: double quotes group
    words, a backslash escapes the next character, and an unquoted ``#`` starts a
    comment. Single quotes mean nothing to it. Newlines cannot be carried at all.
    """
    s = str(value)
    if _CONTROL.search(s):
        raise ValueError(f"control characters cannot go into an #SBATCH line: {s!r}")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./\[\]-]+", s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def slurm_filename(value: Any) -> str:
    """Escape '%' so Slurm's filename patterns (%j, %N...) leave a path alone."""
    return str(value).replace("%", "%%")


def one_line(value: Any) -> str:
    """Printable one-line form for comments: a newline must never end a comment early."""
    return _CONTROL.sub("?", str(value))


def _environment(site_dirs: Sequence[str | os.PathLike] = ()):
    import jinja2

    search = [str(d) for d, _ in template_search_path(site_dirs)]
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch_q"] = sbatch_quote
    env.filters["slurm_filename"] = slurm_filename
    env.filters["one_line"] = one_line
    return env


def render_context(spec: JobSpec) -> Dict[str, Any]:
    """Everything a template sees (plain values)."""
    from clusterops import __version__

    return {
        "spec": spec,
        "version": __version__,
        "nproc_per_node": spec.procs_per_node,
        "world_size": spec.world_size,
        "tasks_per_node": spec.tasks_per_node,
        "alloc_nodes": spec.alloc_nodes,
        "env": list(spec.env),
        "supervise": spec.supervise_dict,
        "spec_json": json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":")),
        "python_script": spec.script.endswith(".py"),
    }


def _template_error(e: Exception, search: List[Path]) -> InputError:
    """One line naming the template file and line of a Jinja failure."""
    import jinja2

    filename = getattr(e, "filename", None)
    lineno = getattr(e, "lineno", None)
    if not filename:
        tb = e.__traceback__
        while tb is not None:
            fn = tb.tb_frame.f_code.co_filename
            if fn.endswith(TEMPLATE_SUFFIX):
                filename, lineno = fn, tb.tb_lineno
            tb = tb.tb_next
    where = f"{filename}:{lineno}" if filename and lineno else (filename or "template")
    kind = "template syntax error" if isinstance(e, jinja2.TemplateSyntaxError) else "template error"
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    return InputError(f"{where}: {kind}: {message}")


def render(spec: JobSpec, template_dirs: Sequence[str | os.PathLike] = ()) -> str:
    """The sbatch script for ``spec`` (pure: reads templates, writes nothing)."""
    import jinja2

    env = _environment(template_dirs)
    name = spec.launcher + TEMPLATE_SUFFIX
    search = [d for d, _ in template_search_path(template_dirs)]
    try:
        template = env.get_template(name)
    except jinja2.TemplateNotFound as e:
        if e.name != name:
            raise _template_error(e, search) from None
        known = sorted(t["name"] for t in list_templates(template_dirs) if t["launcher"])
        where = spec.source or "spec"
        raise InputError(f"{where}: launcher: unknown launcher {spec.launcher!r} "
                         f"(one of {', '.join(known)}){_suggest(spec.launcher, known)}") from None
    except jinja2.TemplateError as e:
        raise _template_error(e, search) from None
    try:
        text = template.render(render_context(spec))
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise _template_error(e, search) from None
    if not text.startswith("#!"):
        raise InputError(f"{template.filename}: rendered script does not start with #!")
    return text


# --------------------------------------------------------------------------------
# Submitting
# --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submitted:
    job_id: Optional[int]  # None for a dry run
    script_path: Optional[str]
    script: str
    sbatch_argv: Tuple[str, ...]

    def to_dict(self) -> Dict[str, Any]:
        return {"job_id": self.job_id, "script_path": self.script_path,
                "sbatch": list(self.sbatch_argv), "dry_run": self.job_id is None}


def script_filename(spec: JobSpec, now: Optional[float] = None) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name).strip("._") or "job"
    stamp = _time.strftime("%Y%m%d-%H%M%S", _time.localtime(now if now is not None else _time.time()))
    return f"{safe}-{stamp}-{os.urandom(3).hex()}.sbatch"


def submit(spec: JobSpec, slurm=None, *, dry_run: bool = False,
           template_dirs: Sequence[str | os.PathLike] = ()) -> Submitted:
    """Render, write the script into log_dir, submit it. Nothing is written on a dry run."""
    text = render(spec, template_dirs)
    path = os.path.join(spec.log_dir, script_filename(spec))
    from clusterops.slurm.steps import sbatch_argv

    argv = tuple(sbatch_argv(path))
    if dry_run:
        return Submitted(None, None, text, argv)
    try:
        os.makedirs(spec.log_dir, exist_ok=True)
        with open(path, "x") as f:
            f.write(text)
        os.chmod(path, 0o755)
    except OSError as e:
        raise ClusteropsError(f"cannot write the script to {spec.log_dir}: {e.strerror or e}") from None
    if slurm is None:
        from clusterops.slurm import Slurm

        slurm = Slurm.from_environment()
    try:
        job_id = slurm.submit(path)
    except BaseException:
        # Nothing half-done: a script that was never submitted is not left behind.
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return Submitted(int(job_id), path, text, argv)


__all__ = [
    "JobSpec", "LAUNCHERS", "KEY_DOCS", "SUPERVISE_DOCS", "Submitted",
    "apply_overrides", "builtin_template_dir", "list_templates", "load_spec", "parse_slurm_time",
    "parse_spec_text", "render", "render_context", "sbatch_quote", "shell_quote", "submit",
    "template_search_path",
]
