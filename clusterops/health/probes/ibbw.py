"""RDMA write bandwidth between two nodes: perftest's ``ib_write_bw`` over one HCA port.

The sweep's pair mode (``clusterops.sweep.pairs``) runs ``clusterops health ibbw`` as one
``srun`` step over the two nodes of a pair, one task per node: task 0 is the server, task
1 the client that connects to the first node's address (``MASTER_ADDR``, as the pair's
all-reduce uses). Each task runs ``ib_write_bw`` through the runner and writes its own JSON
result (``<dir>/server.json``, ``<dir>/client.json``); the pair's result is the client's,
unless either side skipped (:func:`combine`).

- ``ib_write_bw`` not installed, or no HCA in ``/sys/class/infiniband``: ``skip`` with the
  reason (a node without a fabric is not a broken node; never a drain);
- GPUDirect RDMA (``--use_cuda=<gpu>``, buffers in GPU memory) when asked and the node has an
  NVIDIA GPU (``/dev/nvidia<gpu>``);
- the average bandwidth is judged per HCA against the floors in :data:`FLOORS_GBPS` by the
  port's rate name (``NDR``, ``HDR``...), read from sysfs on the client;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

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


def floors_for(rate_name: Optional[str], rate_gbps: Optional[float]) -> Dict[str, Any]:
    """The floors for a port of this rate: the table's, else fractions of the line rate."""
    if rate_name and rate_name.upper() in FLOORS_GBPS:
        return dict(FLOORS_GBPS[rate_name.upper()])
    if rate_gbps:
        return {"fail": round(rate_gbps * DEFAULT_FAIL_FRACTION, 1), "warn": round(rate_gbps * DEFAULT_WARN_FRACTION, 1),
                "source": f"clusterops default: {DEFAULT_FAIL_FRACTION:g}/{DEFAULT_WARN_FRACTION:g} of the line rate"}
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


def pick_port(root: Path, device: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The HCA port to test: ``device``'s first port, else the first ACTIVE port, else None."""
    ports = fabric.read_ports(root, [device] if device else ())
    if not ports:
        return None
    active = [p for p in ports if "ACTIVE" in str(p.get("state", "")).upper()]
    chosen = dict((active or ports)[0])
    chosen["device"], chosen["ib_port"] = chosen["port"].split("/", 1)
    return chosen


def has_nvidia_gpu(host_root: str, gpu: int) -> bool:
    return os.path.exists(os.path.join(host_root, "dev", f"nvidia{int(gpu)}"))


@dataclass
class PairRankOptions:
    report_dir: str                  # this task writes <report_dir>/<role>.json
    peer: Optional[str] = None       # the server's address (client only); default $MASTER_ADDR
    role: Optional[str] = None       # server | client; default from $SLURM_PROCID (0 server)
    device: Optional[str] = None
    tcp_port: int = DEFAULT_TCP_PORT
    size_bytes: int = 1 << 20
    iters: int = 2000
    timeout_s: float = 60.0
    gpudirect: bool = False
    gpu: int = 0
    sysfs_root: str = "/sys/class/infiniband"
    host_root: str = "/"


def run_rank(opts: PairRankOptions, *, runner: Optional[Runner] = None,
             env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """One side of the pair test. Writes and returns ``{role, status, gbps, detail, ...}``."""
    env = dict(os.environ) if env is None else env
    runner = runner or Runner()
    role = opts.role or ("server" if str(env.get("SLURM_PROCID", "0")) == "0" else "client")
    doc: Dict[str, Any] = {"role": role, "node": env.get("SLURMD_NODENAME") or os.uname().nodename,
                           "status": "skip", "gbps": None, "detail": "", "gpudirect": False}
    port = pick_port(Path(opts.sysfs_root), opts.device)
    if port is None:
        doc["detail"] = f"no HCA: nothing under {opts.sysfs_root}"
        return _write(opts.report_dir, doc)
    rate_gbps, rate_name = port.get("rate_gbps"), port.get("speed")
    gpu = opts.gpu if opts.gpudirect and has_nvidia_gpu(opts.host_root, opts.gpu) else None
    doc.update(device=port["device"], ib_port=port["ib_port"], rate=rate_name, gpudirect=gpu is not None)
    peer = opts.peer or env.get("MASTER_ADDR")
    try:
        argv = perftest_argv(role, device=str(port["device"]), ib_port=int(port["ib_port"]), tcp_port=opts.tcp_port,
                             peer=peer, size_bytes=opts.size_bytes, iters=opts.iters, gpu=gpu)
    except ValueError as e:
        doc.update(status="error", detail=str(e))
        return _write(opts.report_dir, doc)
    doc["argv"] = argv
    start = time.monotonic()
    deadline = start + opts.timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            done = runner.run(argv, timeout_s=max(1.0, deadline - time.monotonic()), check=False)
        except CommandNotFound:
            doc["detail"] = f"{PROGRAM} not installed (perftest)"
            return _write(opts.report_dir, doc)
        except CommandTimeout:
            doc.update(judge(Parsed(ok=False, device=str(port["device"])), {}, timed_out=True))
            return _write(opts.report_dir, doc)
        parsed = parse_output((done.stdout or "") + "\n" + (done.stderr or ""))
        # The two tasks start at the same moment: a client that came before its server
        # listens is refused; it tries again while its deadline allows.
        if role != "client" or parsed.kind != "connect" or time.monotonic() + CONNECT_RETRY_S >= deadline:
            break
        time.sleep(CONNECT_RETRY_S)
    doc["attempts"] = attempts
    parsed.device = parsed.device or str(port["device"])
    floors = floors_for(rate_name, rate_gbps)
    verdict = judge(parsed, floors)
    if parsed.ok and done.returncode != 0:
        verdict = {"status": "fail", "gbps": verdict["gbps"], "detail": f"{verdict['detail']} (exit {done.returncode})"}
    doc.update(verdict, floors=floors, duration_s=round(time.monotonic() - start, 3))
    if role == "server" and doc["status"] in ("pass", "warn"):
        doc["status"] = "pass"       # the client's figure is the pair's; the server only served
    return _write(opts.report_dir, doc)


def _write(report_dir: str, doc: Dict[str, Any]) -> Dict[str, Any]:
    os.makedirs(report_dir, exist_ok=True)
    path = os.path.join(report_dir, f"{doc['role']}.json")
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(doc, f, sort_keys=True)
    os.replace(tmp, path)
    return doc


def combine(server: Optional[Mapping[str, Any]], client: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The pair's result from its two sides: a skip on either side is the pair's skip (with
    its reason); otherwise the client's figure and status; a side without a result is fail."""
    for side in (server, client):
        if isinstance(side, Mapping) and side.get("status") == "skip":
            return {"status": "skip", "gbps": None, "detail": f"{side.get('node', '?')}: {side.get('detail', '')}",
                    "gpudirect": False}
    for side in (server, client):
        if isinstance(side, Mapping) and side.get("status") == "error":
            return {"status": "error", "gbps": None, "detail": f"{side.get('node', '?')}: {side.get('detail', '')}",
                    "gpudirect": False}
    if not isinstance(client, Mapping):
        return {"status": "fail", "gbps": None, "detail": "no result from the client side", "gpudirect": False}
    return {"status": client.get("status", "fail"), "gbps": client.get("gbps"), "detail": client.get("detail", ""),
            "gpudirect": bool(client.get("gpudirect")), "rate": client.get("rate")}


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
        return {"status": "error", "gbps": None, "gpudirect": False,
                "detail": "no result from either side" + (f": {tail}" if tail else "")}
    return combine(sides["server"], sides["client"])
