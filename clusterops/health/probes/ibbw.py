"""RDMA write bandwidth between two nodes: perftest's ``ib_write_bw`` on every rail.

The sweep's pair mode (``clusterops.sweep.pairs``) runs ``clusterops health ibbw --profile P``
as one ``srun`` step over the two nodes of a pair, one task per node: task 0 is the server,
task 1 the client that connects to the first node's address (``MASTER_ADDR``, as the pair's
all-reduce uses). The settings are the profile's ``probes.ibbw`` (``clusterops.schema``;
:func:`options_from_profile`). Each task runs ``ib_write_bw`` through the runner on each rail
in turn and writes its own JSON result (``<dir>/server.json``, ``<dir>/client.json``); the
pair's result is the client's, unless either side skipped (:func:`combine`).

- rails: every ACTIVE HCA port (``all_rails``; sorted by name, the same order on both
  nodes), rail ``i`` on TCP port ``tcp_port + i``; one result per rail, the pair's verdict
  the worst rail's, its figure the slowest rail's; rails only one node has fail the pair;
- ``ib_write_bw`` not installed, or no HCA in ``/sys/class/infiniband``: ``skip`` with the
  reason (a node without a fabric is not a broken node; never a drain);
- RoCE ports (link layer Ethernet) take ``-x <GID index>``, chosen from sysfs by
  :func:`gid_index` (RoCE v2 with an IPv4-mapped address first); InfiniBand ports none;
- GPUDirect RDMA (``--use_cuda=<gpu>``, buffers in GPU memory) when asked and the node has an
  NVIDIA GPU (``/dev/nvidia<gpu>``);
- each rail's average bandwidth is judged against the floors in :data:`FLOORS_GBPS` (and the
  profile's ``floors``) by the port's rate name (``NDR``, ``HDR``...), read from sysfs;
- a connection failure, a timeout or output with no result line is ``fail`` (the link between
  the two nodes did not carry the test), with perftest's own line in the detail.

The argv of both sides is built by :func:`perftest_argv` alone; the output is parsed by
:func:`parse_output`.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops.health.probes import fabric
from clusterops.runner import CommandNotFound, CommandTimeout, Runner

PROGRAM = "ib_write_bw"
DEFAULT_TCP_PORT = 18515          # perftest's default port for its out-of-band exchange
CONNECT_RETRY_S = 1.0             # the client's pause before it tries a server not yet listening

#: Per-HCA floors of the average ``ib_write_bw`` bandwidth, in Gb/s, by the port's rate name.
#: ``fail`` below, ``warn`` below ``warn``. Each figure names its source.
FLOORS_GBPS: Dict[str, Dict[str, Any]] = {
    # Azure azurehpc-health-checks: ib_write_bw per HCA on NDR (ND H100 v5) fails below 380 Gb/s.
    # The warn figure (98% of the 400 Gb/s line rate) is clusterops' own starting point.
    "NDR": {"fail": 380.0, "warn": 392.0, "source": "Azure azurehpc-health-checks (fail); clusterops (warn)"},
}
#: Rates with no published floor: fail below this fraction of the port's line rate, warn
#: below the second (clusterops' own starting points, not a published figure).
DEFAULT_FAIL_FRACTION = 0.90
DEFAULT_WARN_FRACTION = 0.95

_RESULT = re.compile(r"^\s*(\d+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*$")
_UNITS = re.compile(r"BW average\[(Gb/sec|MB/sec|MiB/sec)\]")
_NO_DEVICE = ("no ib devices found", "failed to get ib devices list", "ib device", "couldn't get device")
_CONNECT = ("couldn't connect", "unable to init the socket connection", "failed to exchange data",
            "unable to open file descriptor for socket connection", "couldn't read remote address",
            "failed to create qp", "failed to modify qp", "problems with warm up", "completion with error")


@dataclass
class Parsed:
    """What one ``ib_write_bw`` output says: the result line's figures, or why there is none."""

    ok: bool
    avg_gbps: Optional[float] = None
    peak_gbps: Optional[float] = None
    msg_bytes: Optional[int] = None
    iterations: Optional[int] = None
    device: Optional[str] = None
    kind: str = "ok"                 # ok | no_device | connect | garbage
    line: str = ""                   # perftest's own words for what went wrong


def perftest_argv(role: str, *, device: str, ib_port: int = 1, tcp_port: int = DEFAULT_TCP_PORT,
                  peer: Optional[str] = None, size_bytes: int = 1 << 20, iters: int = 2000,
                  gpu: Optional[int] = None, gid_index: Optional[int] = None) -> List[str]:
    """``ib_write_bw`` for the ``server`` (waits for one client) or the ``client`` (connects
    to ``peer``). Both sides must be given the same size, iterations and port."""
    if role not in ("server", "client"):
        raise ValueError(f"role must be server or client, got {role!r}")
    if role == "client" and not peer:
        raise ValueError("the client needs the server's address (peer)")
    argv = [PROGRAM, "-d", device, "-i", str(int(ib_port)), "-p", str(int(tcp_port)),
            "-s", str(int(size_bytes)), "-n", str(int(iters)), "-F", "--report_gbits"]
    if gid_index is not None:
        argv += ["-x", str(int(gid_index))]   # RoCE: the GID to use
    if gpu is not None:
        argv.append(f"--use_cuda={int(gpu)}")
    if role == "client":
        argv.append(str(peer))
    return argv


def parse_output(text: str) -> Parsed:
    """Parse perftest's report (stdout and stderr together). The result is the last line
    of five figures under a ``BW average[Gb/sec]`` header; MB/sec reports are converted."""
    dev = re.search(r"Device\s*:\s*(\S+)", text)
    device = dev.group(1) if dev else None
    units = _UNITS.search(text)
    result = None
    for line in text.splitlines():
        m = _RESULT.match(line)
        if m:
            result = m
    if units and result:
        scale = {"Gb/sec": 1.0, "MB/sec": 8e-3, "MiB/sec": 8 * 1.048576e-3}[units.group(1)]
        return Parsed(ok=True, msg_bytes=int(result.group(1)), iterations=int(result.group(2)),
                      peak_gbps=float(result.group(3)) * scale, avg_gbps=float(result.group(4)) * scale,
                      device=device)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= set("-")]
    low = [ln.lower() for ln in lines]
    for kind, needles in (("no_device", _NO_DEVICE), ("connect", _CONNECT)):
        for ln, lo in zip(lines, low):
            if any(n in lo for n in needles):
                if kind == "no_device" and "ib device" in lo and "not found" not in lo:
                    continue
                return Parsed(ok=False, kind=kind, line=ln[:200], device=device)
    return Parsed(ok=False, kind="garbage", line=(lines[-1][:200] if lines else "no output"), device=device)


def floors_for(rate_name: Optional[str], rate_gbps: Optional[float],
               cfg: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The floors for a port of this rate: the profile's ``floors.<RATE>`` over the built-in
    table, else the profile's fractions (``fail_fraction``, ``warn_fraction``) of the line rate."""
    cfg = cfg or {}
    name = (rate_name or "").upper()
    site = (cfg.get("floors") or {}).get(name) if name else None
    if name in FLOORS_GBPS or site:
        out = dict(FLOORS_GBPS.get(name) or {"fail": None, "warn": None, "source": ""})
        if site:
            out.update({k: site[k] for k in ("fail", "warn") if k in site})
            out["source"] = "the profile's ibbw.floors." + name
        return out
    fail_f = float(cfg.get("fail_fraction", DEFAULT_FAIL_FRACTION))
    warn_f = float(cfg.get("warn_fraction", DEFAULT_WARN_FRACTION))
    if rate_gbps:
        return {"fail": round(rate_gbps * fail_f, 1), "warn": round(rate_gbps * warn_f, 1),
                "source": f"clusterops default: {fail_f:g}/{warn_f:g} of the line rate"}
    return {"fail": None, "warn": None, "source": "no rate known"}


def judge(parsed: Parsed, floors: Mapping[str, Any], *, timed_out: bool = False) -> Dict[str, Any]:
    """pass/warn/fail for one client result against one HCA's floors."""
    dev = parsed.device or "?"
    if timed_out:
        return {"status": "fail", "gbps": None, "detail": f"{dev}: ib_write_bw timed out (no peer, or the link is down)"}
    if not parsed.ok:
        if parsed.kind == "no_device":
            return {"status": "skip", "gbps": None, "detail": f"no HCA: {parsed.line}"}
        what = "connection failed" if parsed.kind == "connect" else "no result in ib_write_bw output"
        return {"status": "fail", "gbps": None, "detail": f"{dev}: {what}: {parsed.line}"}
    gbps = round(float(parsed.avg_gbps or 0.0), 2)
    fail, warn = floors.get("fail"), floors.get("warn")
    src = floors.get("source", "")
    if fail is not None and gbps < fail:
        return {"status": "fail", "gbps": gbps, "detail": f"{dev}: {gbps:g} Gb/s < floor {fail:g} Gb/s ({src})"}
    if warn is not None and gbps < warn:
        return {"status": "warn", "gbps": gbps, "detail": f"{dev}: {gbps:g} Gb/s < {warn:g} Gb/s ({src})"}
    return {"status": "pass", "gbps": gbps, "detail": f"{dev}: {gbps:g} Gb/s"}


# -- RoCE: which GID ------------------------------------------------------------------------

_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_V4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def gid_index(root: Path, device: str, ib_port: Any) -> Optional[int]:
    """The GID index ``ib_write_bw -x`` needs on a RoCE port, from sysfs
    (``<dev>/ports/<p>/gids/<n>`` and ``gid_attrs/types/<n>``): the lowest index whose type is
    ``RoCE v2`` and whose GID is an IPv4-mapped address (``::ffff:a.b.c.d``, routable across
    subnets), else the lowest RoCE v2 index with any GID set, else None (perftest's own
    default, index 0). Empty entries (all-zero GIDs, unreadable types) are passed over."""
    port = Path(root) / device / "ports" / str(ib_port)
    gids = port / "gids"
    if not gids.is_dir():
        return None
    v2: List[int] = []
    mapped: List[int] = []
    for entry in gids.iterdir():
        if not entry.name.isdigit():
            continue
        n = int(entry.name)
        gid = fabric._read(entry).lower()
        if not gid or gid == _ZERO_GID:
            continue
        kind = fabric._read(port / "gid_attrs" / "types" / entry.name)
        if kind.strip().lower() != "roce v2":
            continue
        v2.append(n)
        if gid.startswith(_V4_MAPPED):
            mapped.append(n)
    if mapped:
        return min(mapped)
    return min(v2) if v2 else None


def is_roce(port: Mapping[str, Any]) -> bool:
    return str(port.get("link_layer", "")).lower() == "ethernet"


# -- which ports: the rails ------------------------------------------------------------------

def pick_rails(root: Path, *, devices: Sequence[str] = (), link_layers: Sequence[str] = ("InfiniBand", "Ethernet"),
               all_rails: bool = True, gid: Optional[int] = None) -> Tuple[List[Dict[str, Any]], int]:
    """The rails to test: every ACTIVE port (sorted by name) of the HCAs ``devices`` names
    (patterns; empty: all) on the ``link_layers``, or the first one alone without
    ``all_rails``. Each with ``device``, ``ib_port``, ``rate`` (the rate's name), ``rate_gbps``,
    ``link_layer`` and ``gid_index`` (RoCE: ``gid``, else chosen from sysfs; InfiniBand:
    None). Returns (rails, ports seen)."""
    layers = {str(x).lower() for x in link_layers}
    ports = [p for p in fabric.read_ports(Path(root), list(devices))
             if str(p.get("link_layer", "InfiniBand")).lower() in layers]
    rails: List[Dict[str, Any]] = []
    for p in ports:
        if "ACTIVE" not in str(p.get("state", "")).upper():
            continue
        dev, ib_port = p["port"].split("/", 1)
        rail = {"rail": p["port"], "device": dev, "ib_port": ib_port, "rate": p.get("speed"),
                "rate_gbps": p.get("rate_gbps"), "link_layer": p.get("link_layer"), "gid_index": None}
        if is_roce(p):
            rail["gid_index"] = gid if gid is not None else gid_index(Path(root), dev, ib_port)
        rails.append(rail)
    return (rails if all_rails else rails[:1]), len(ports)


def pick_port(root: Path, device: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The first rail of ``device`` (or of any HCA), or None: :func:`pick_rails` for one port."""
    rails, _ = pick_rails(root, devices=[device] if device else (), all_rails=False)
    return rails[0] if rails else None


def has_nvidia_gpu(host_root: str, gpu: int) -> bool:
    return os.path.exists(os.path.join(host_root, "dev", f"nvidia{int(gpu)}"))


@dataclass
class PairRankOptions:
    report_dir: str                  # this task writes <report_dir>/<role>.json
    peer: Optional[str] = None       # the server's address (client only); default $MASTER_ADDR
    role: Optional[str] = None       # server | client; default from $SLURM_PROCID (0 server)
    device: Optional[str] = None     # one HCA only (overrides devices)
    tcp_port: int = DEFAULT_TCP_PORT  # rail i: tcp_port + i
    size_bytes: int = 1 << 20
    iters: int = 2000
    timeout_s: float = 60.0          # per rail
    gpudirect: bool = False
    gpu: int = 0
    sysfs_root: str = "/sys/class/infiniband"
    host_root: str = "/"
    devices: Tuple[str, ...] = ()
    link_layers: Tuple[str, ...] = ("InfiniBand", "Ethernet")
    all_rails: bool = True
    gid_index: Optional[int] = None  # RoCE: force this GID index
    floors: Dict[str, Any] = field(default_factory=dict)   # the profile's ibbw settings for floors_for


def options_from_profile(cfg: Mapping[str, Any], report_dir: str, **over: Any) -> PairRankOptions:
    """A rank's options from a profile's ``probes.ibbw`` settings (validated by
    ``clusterops.schema``), with the command line's ``over`` (None: not given) on top."""
    opts = PairRankOptions(
        report_dir=report_dir,
        sysfs_root=str(cfg.get("sys_root", "/sys/class/infiniband")),
        devices=tuple(cfg.get("devices") or ()),
        link_layers=tuple(cfg.get("link_layers") or ("InfiniBand", "Ethernet")),
        all_rails=bool(cfg.get("all_rails", True)),
        gpudirect=bool(cfg.get("gpudirect", False)),
        gpu=int(cfg.get("gpu", 0)),
        gid_index=cfg.get("gid_index"),
        tcp_port=int(cfg.get("tcp_port", DEFAULT_TCP_PORT)),
        size_bytes=int(cfg.get("size_bytes", 1 << 20)),
        iters=int(cfg.get("iters", 2000)),
        timeout_s=float(cfg.get("timeout_s", 60.0)),
        floors={"floors": dict(cfg.get("floors") or {}),
                "fail_fraction": cfg.get("fail_fraction", DEFAULT_FAIL_FRACTION),
                "warn_fraction": cfg.get("warn_fraction", DEFAULT_WARN_FRACTION)},
    )
    for k, v in over.items():
        if v is not None:
            setattr(opts, k, v)
    return opts


_ORDER = {"skip": 0, "pass": 1, "warn": 2, "fail": 3, "error": 4}


def _worst(statuses: Sequence[str]) -> str:
    return max(statuses, key=lambda s: _ORDER.get(s, 3)) if statuses else "skip"


def run_rank(opts: PairRankOptions, *, runner: Optional[Runner] = None,
             env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """One side of the pair test, rail after rail. Writes and returns ``{role, status, gbps,
    detail, rails, results: [one per rail], ...}``; ``gbps`` is the slowest rail's."""
    env = dict(os.environ) if env is None else env
    runner = runner or Runner()
    role = opts.role or ("server" if str(env.get("SLURM_PROCID", "0")) == "0" else "client")
    doc: Dict[str, Any] = {"role": role, "node": env.get("SLURMD_NODENAME") or os.uname().nodename,
                           "status": "skip", "gbps": None, "detail": "", "gpudirect": False,
                           "rails": [], "results": []}
    devices = (opts.device,) if opts.device else tuple(opts.devices)
    rails, seen = pick_rails(Path(opts.sysfs_root), devices=devices, link_layers=opts.link_layers,
                             all_rails=opts.all_rails, gid=opts.gid_index)
    if not rails:
        if seen:
            doc.update(status="fail", detail=f"none of the {seen} HCA ports under {opts.sysfs_root} is ACTIVE")
        else:
            doc["detail"] = f"no HCA: nothing under {opts.sysfs_root}"
        return _write(opts.report_dir, doc)
    gpu = opts.gpu if opts.gpudirect and has_nvidia_gpu(opts.host_root, opts.gpu) else None
    peer = opts.peer or env.get("MASTER_ADDR")
    doc.update(rails=[r["rail"] for r in rails], gpudirect=gpu is not None,
               device=rails[0]["device"], ib_port=rails[0]["ib_port"], rate=rails[0]["rate"])
    for i, rail in enumerate(rails):
        res = _run_rail(role, rail, i, opts, runner, peer, gpu)
        if res is None:
            doc.update(status="skip", detail=f"{PROGRAM} not installed (perftest)", results=[])
            return _write(opts.report_dir, doc)
        if res["status"] == "error":
            doc.update(status="error", detail=res["detail"])
            return _write(opts.report_dir, doc)
        doc["results"].append(res)
    doc.update(_fold(doc["results"]))
    if role == "server" and doc["status"] in ("pass", "warn"):
        doc["status"] = "pass"       # the client's figures are the pair's; the server only served
    return _write(opts.report_dir, doc)


def _run_rail(role: str, rail: Mapping[str, Any], index: int, opts: PairRankOptions, runner: Runner,
              peer: Optional[str], gpu: Optional[int]) -> Optional[Dict[str, Any]]:
    """One rail's ``ib_write_bw`` under its own deadline -> its result (None: not installed)."""
    out: Dict[str, Any] = {"rail": rail["rail"], "device": rail["device"], "ib_port": rail["ib_port"],
                           "rate": rail["rate"], "link_layer": rail["link_layer"], "gid_index": rail["gid_index"]}
    try:
        argv = perftest_argv(role, device=str(rail["device"]), ib_port=int(rail["ib_port"]),
                             tcp_port=opts.tcp_port + index, peer=peer, size_bytes=opts.size_bytes,
                             iters=opts.iters, gpu=gpu, gid_index=rail["gid_index"])
    except ValueError as e:
        out.update(status="error", gbps=None, detail=str(e))
        return out
    out["argv"] = argv
    start = time.monotonic()
    deadline = start + opts.timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            done = runner.run(argv, timeout_s=max(1.0, deadline - time.monotonic()), check=False)
        except CommandNotFound:
            return None
        except CommandTimeout:
            out.update(judge(Parsed(ok=False, device=str(rail["device"])), {}, timed_out=True),
                       attempts=attempts, duration_s=round(time.monotonic() - start, 3))
            return out
        parsed = parse_output((done.stdout or "") + "\n" + (done.stderr or ""))
        # The two tasks start each rail at about the same moment: a client that came before
        # its server listens is refused; it tries again while its deadline allows.
        if role != "client" or parsed.kind != "connect" or time.monotonic() + CONNECT_RETRY_S >= deadline:
            break
        time.sleep(CONNECT_RETRY_S)
    parsed.device = str(rail["device"])     # the rail asked for names the result
    floors = floors_for(rail["rate"], rail["rate_gbps"], opts.floors)
    verdict = judge(parsed, floors)
    if parsed.ok and done.returncode != 0:
        verdict = {"status": "fail", "gbps": verdict["gbps"], "detail": f"{verdict['detail']} (exit {done.returncode})"}
    out.update(verdict, floors=floors, attempts=attempts, duration_s=round(time.monotonic() - start, 3))
    return out


def _fold(results: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Rails -> one verdict: the worst rail's status, the slowest rail's Gb/s, the detail of
    the rails that did not pass (or of the slowest)."""
    status = _worst([str(r.get("status", "fail")) for r in results])
    figures = [float(r["gbps"]) for r in results if isinstance(r.get("gbps"), (int, float))]
    gbps = min(figures) if figures else None
    bad = [r for r in results if r.get("status") in ("fail", "warn", "error")]
    if bad:
        detail = "; ".join(str(r.get("detail", "")) for r in bad[:4])
        if len(bad) > 4:
            detail += f"; and {len(bad) - 4} more rails"
    elif len(results) == 1:
        detail = str(results[0].get("detail", ""))
    else:
        detail = f"{len(results)} rails, slowest {gbps:g} Gb/s" if gbps is not None else f"{len(results)} rails"
    return {"status": status, "gbps": gbps, "detail": detail}


def _write(report_dir: str, doc: Dict[str, Any]) -> Dict[str, Any]:
    os.makedirs(report_dir, exist_ok=True)
    path = os.path.join(report_dir, f"{doc['role']}.json")
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
    os.replace(tmp, path)
    return doc


def _rails_of(side: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """A side's per-rail results (a one-rail document written before rails: itself)."""
    if isinstance(side.get("results"), list) and side["results"]:
        return [dict(r) for r in side["results"] if isinstance(r, Mapping)]
    return [{"rail": side.get("device") and f"{side.get('device')}/{side.get('ib_port', 1)}",
             "status": side.get("status", "fail"), "gbps": side.get("gbps"), "detail": side.get("detail", ""),
             "rate": side.get("rate")}]


_RAIL_KEYS = ("rail", "status", "gbps", "detail", "rate", "link_layer", "gid_index")


def combine(server: Optional[Mapping[str, Any]], client: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The pair's result from its two sides: a skip on either side is the pair's skip (with
    its reason); otherwise the client's rails, the worst rail the pair's status and the
    slowest its figure; a side without a result is fail, and so are rails only one side has."""
    for side in (server, client):
        if isinstance(side, Mapping) and side.get("status") == "skip":
            return {"status": "skip", "gbps": None, "detail": f"{side.get('node', '?')}: {side.get('detail', '')}",
                    "gpudirect": False, "rails": []}
    for side in (server, client):
        if isinstance(side, Mapping) and side.get("status") == "error":
            return {"status": "error", "gbps": None, "detail": f"{side.get('node', '?')}: {side.get('detail', '')}",
                    "gpudirect": False, "rails": []}
    if not isinstance(client, Mapping):
        return {"status": "fail", "gbps": None, "detail": "no result from the client side", "gpudirect": False,
                "rails": []}
    rails = [{k: r.get(k) for k in _RAIL_KEYS} for r in _rails_of(client)]
    out = {"status": client.get("status", "fail"), "gbps": client.get("gbps"), "detail": client.get("detail", ""),
           "gpudirect": bool(client.get("gpudirect")), "rate": client.get("rate"), "rails": rails}
    if rails and isinstance(client.get("results"), list):
        out.update(_fold(rails))
    if isinstance(server, Mapping) and server.get("rails") and client.get("rails"):
        only_s = [r for r in server["rails"] if r not in client["rails"]]
        only_c = [r for r in client["rails"] if r not in server["rails"]]
        if only_s or only_c:
            what = "; ".join(x for x in (
                f"only {server.get('node', 'server')} has ACTIVE {', '.join(map(str, only_s))}" if only_s else "",
                f"only {client.get('node', 'client')} has ACTIVE {', '.join(map(str, only_c))}" if only_c else "")
                if x)
            out.update(status="fail", detail=f"the nodes' rails differ: {what}" + (
                f"; {out['detail']}" if out["detail"] else ""))
    return out


def read_pair(report_dir: Path) -> Dict[str, Any]:
    """:func:`combine` over the two files one pair's step wrote (a missing or torn file
    counts as no result from that side)."""
    sides: Dict[str, Optional[Mapping[str, Any]]] = {}
    for role in ("server", "client"):
        try:
            doc = json.loads((Path(report_dir) / f"{role}.json").read_text())
        except (OSError, ValueError):
            doc = None
        sides[role] = doc if isinstance(doc, Mapping) else None
    if sides["server"] is None and sides["client"] is None:
        # The step wrote nothing: it did not start (srun, clusterops missing on the node) or
        # died; that says nothing about the link: error, with the step's own last words.
        try:
            tail = Path(f"{report_dir}.err").read_text(errors="replace")[-300:].strip()
        except OSError:
            tail = ""
        return {"status": "error", "gbps": None, "gpudirect": False, "rails": [],
                "detail": "no result from either side" + (f": {tail}" if tail else "")}
    return combine(sides["server"], sides["client"])
