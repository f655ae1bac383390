"""Fabric probe: InfiniBand and RoCE ports from sysfs, their error counters and link flaps.

The kernel's RDMA core writes one directory per HCA port (Documentation/ABI/stable/
sysfs-class-infiniband)::

    /sys/class/infiniband/<dev>/ports/<n>/state        "4: ACTIVE"
                                         /phys_state   "5: LinkUp"
                                         /rate         "400 Gb/sec (4X NDR)"
                                         /link_layer   "InfiniBand" | "Ethernet" (RoCE)
                                         /counters/<name>   one decimal number each

Which ports are judged: a node's RDMA devices carry ports nobody uses (the second
port of a dual-port card, an Ethernet NIC that the kernel lists because it can do RoCE),
so a port is held to the rules only when an expectation names it. ``ports`` (shell
patterns on ``<dev>/<port>``, or a device name for all its ports), from the profile or
the site config, names them; without it, the ports of the ``devices`` named; without
either, the InfiniBand ports (an InfiniBand port is there for the fabric; an Ethernet
port's RoCE use must be named). Only ``link_layers`` are judged. Every other port is
only reported: listed in the result (``data`` and the detail), never failed; when
nothing names the ports, such a port that is down warns (the probe cannot tell whether
it carries RoCE). A named pattern that matches no port fails (an HCA that fell off the
bus is not a healthy node).

Three results, each a rule folded over the judged ports:

- ``fabric.ports``: every judged port ACTIVE and LinkUp, at the expected rate and width (a
  ``2X`` port on a ``4X`` cable is a degraded link: the rate halves, and the job that
  spans it runs at that rate);
- ``fabric.errors``: how much each error counter rose within the window (``window_h``),
  from the counter values this probe keeps in the node's local state between checks
  (:mod:`clusterops.health.probes.state`, as the Xid probe keeps its events): a counter
  is judged by its rise, never its absolute value (a counter that counted for a year
  says nothing about today), and an error stays counted until it leaves the window, so
  the node does not pass again at the very next check;
- ``fabric.flaps``: rises of ``link_downed`` (the port went down and came back) within the
  window.

The first check on a node records a baseline and judges no counters. A counter that went
down was reset (driver reload, ``perfquery -x``): its value is the rise. The classic
counters are narrow and saturate (InfiniBand Architecture Specification, PortCounters:
SymbolErrorCounter and PortRcvErrors 16 bits, LinkErrorRecoveryCounter and LinkDownedCounter
8 bits, ExcessiveBufferOverrunErrors 4 bits): a saturated counter cannot show a rise and
is reported, with how to reset it.

No torch, no subprocess: the ``fast`` profile runs it in milliseconds.
"""

from __future__ import annotations

import fnmatch
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops.fsutil import read_regular
from clusterops.health.probes import state as local_state
from clusterops.health.probes.base import ProbeContext, ProbeResult

SYSFS_MAX_BYTES = 4096

#: Counter name -> width in bits (saturating), from the IB spec's PortCounters attribute.
#: The names a profile's ``counters:`` may judge; link_downed is judged as flaps.
COUNTER_BITS: Dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
}
FLAP_COUNTER = "link_downed"
WIDTHS = ("1X", "2X", "4X", "8X", "12X")
LINK_LAYERS = ("InfiniBand", "Ethernet")
#: Counter rises kept in the state file, newest last (a flapping port adds one per check).
MAX_EVENTS = 1000

_RATE = re.compile(r"\s*([\d.]+)\s*Gb/sec(?:\s*\((\d+X)\s*([A-Z0-9]*)\))?")


def parse_rate(text: str) -> Tuple[Optional[float], Optional[str], Optional[str]]:
    """``"400 Gb/sec (4X NDR)"`` -> (400.0, "4X", "NDR"); parts missing -> None."""
    m = _RATE.match(text or "")
    if not m:
        return None, None, None
    return float(m.group(1)), m.group(2), (m.group(3) or None)


def _read(path: Path) -> str:
    """One sysfs attribute ("" when absent or unreadable)."""
    try:
        return read_regular(path, SYSFS_MAX_BYTES)[0].decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def read_ports(root: Path, devices: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """Every port under ``root`` (sorted), with its state, rate and counters."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.glob("*/ports/*")):
        dev = p.parent.parent.name
        if devices and not any(fnmatch.fnmatchcase(dev, pat) for pat in devices):
            continue
        rate_text = _read(p / "rate")
        gbps, width, speed = parse_rate(rate_text)
        counters: Dict[str, int] = {}
        for name in COUNTER_BITS:
            raw = _read(p / "counters" / name)
            if raw.isdigit():
                counters[name] = int(raw)
        out.append({"port": f"{dev}/{p.name}", "state": _read(p / "state"),
                    "phys_state": _read(p / "phys_state"), "rate": rate_text, "rate_gbps": gbps,
                    "width": width, "speed": speed, "link_layer": _read(p / "link_layer") or "InfiniBand",
                    "counters": counters})
    return out


def _word(text: str) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``."""
    return text.split(":")[-1].strip() or "unknown"


def _width_n(width: Optional[str]) -> int:
    return int(width[:-1]) if width and width[:-1].isdigit() else 0


def _named_by(port: Mapping[str, Any], patterns: Sequence[str]) -> bool:
    """``mlx5_0/1`` is named by ``mlx5_0/1``, ``mlx5_*/1`` or the device pattern ``mlx5_[0-3]``."""
    dev = port["port"].split("/")[0]
    return any(fnmatch.fnmatchcase(port["port"], pat) or fnmatch.fnmatchcase(dev, pat) for pat in patterns)


def split_ports(ports: List[Dict[str, Any]], cfg: Mapping[str, Any]) -> Tuple[
        List[Dict[str, Any]], List[Dict[str, Any]], List[str]]:
    """(judged, reported, named patterns that match no port) under the profile's expectations.

    Each reported port gets ``why`` (why it is not judged) and ``unsure`` (True when nothing
    names the node's ports, so the probe cannot tell whether it is used: a down one warns).
    """
    layers = cfg.get("link_layers") or LINK_LAYERS
    named = list(cfg.get("ports") or ())
    devices = list(cfg.get("devices") or ())
    judged: List[Dict[str, Any]] = []
    reported: List[Dict[str, Any]] = []
    for p in ports:
        dev = p["port"].split("/")[0]
        why, unsure = "", False
        if devices and not any(fnmatch.fnmatchcase(dev, pat) for pat in devices):
            why = "device not in devices"
        elif p["link_layer"] not in layers:
            why = f"link layer {p['link_layer']} not in link_layers"
        elif named:
            why = "" if _named_by(p, named) else "not named in ports"
        elif not devices and p["link_layer"] != "InfiniBand":
            # An Ethernet port of an RDMA device may be plain Ethernet or unused: its RoCE
            # use is judged only once the profile or the site names it.
            why, unsure = f"{p['link_layer']}, RoCE use not named (ports)", True
        if why:
            reported.append(dict(p, why=why, unsure=unsure))
        else:
            judged.append(p)
    missing = [pat for pat in named if not any(_named_by(p, [pat]) for p in ports)]
    return judged, reported, missing


def _listing(judged: Sequence[Mapping[str, Any]], reported: Sequence[Mapping[str, Any]]) -> Tuple[
        Dict[str, Any], str]:
    """(per-port data, ``judged: ...; only reported: ...``) for the result.

    The detail says which ports the verdict is about and which were only looked at: a
    reader of a fail (or of a drain reason cut from it) must see that an unused port did
    not decide it.
    """
    keys = ("state", "phys_state", "rate", "rate_gbps", "width", "link_layer")
    data = {p["port"]: dict({k: p[k] for k in keys}, judged=True) for p in judged}
    data.update({p["port"]: dict({k: p[k] for k in keys}, judged=False, why=p["why"]) for p in reported})
    scope = f"judged: {', '.join(p['port'] for p in judged) or 'none'}"
    if reported:
        scope += "; only reported: " + ", ".join(f"{p['port']} {_word(p['state'])}" for p in reported)
    return data, scope


def rule_ports(ports: List[Dict[str, Any]], cfg: Mapping[str, Any],
               reported: Sequence[Mapping[str, Any]] = (), missing: Sequence[str] = ()) -> ProbeResult:
    """State, physical state, rate and width of each judged port; ``reported`` ports (no
    expectation names them) are listed, and at most warn when down; ``missing`` are named
    patterns that match no port (fail)."""
    expected_rate = cfg.get("expected_rate_gbps")
    expected_width = cfg.get("expected_width")
    min_ports = int(cfg.get("min_ports") or 0)
    fails: List[str] = [f"expected port {pat} not found" for pat in missing]
    warns: List[str] = [f"{p['port']} {_word(p['state'])} (not judged: {p['why']}; name it in ports "
                        "if it carries RDMA traffic)"
                        for p in reported if p.get("unsure") and _word(p["state"]) != "ACTIVE"]
    active = [p for p in ports if _word(p["state"]) == "ACTIVE"]
    for p in ports:
        if _word(p["state"]) != "ACTIVE":
            fails.append(f"{p['port']} {_word(p['state'])}")
            continue
        if p["phys_state"] and _word(p["phys_state"]) != "LinkUp":
            fails.append(f"{p['port']} physical state {_word(p['phys_state'])}")
            continue
        if expected_rate and (p["rate_gbps"] is None or p["rate_gbps"] < float(expected_rate)):
            fails.append(f"{p['port']} at {p['rate'] or 'unknown rate'} < {expected_rate:g} Gb/sec")
        if expected_width and _width_n(p["width"]) < _width_n(expected_width):
            fails.append(f"{p['port']} width {p['width'] or 'unknown'} < {expected_width} (degraded link)")
    if not expected_width:
        # Without a stated width: a port narrower than the node's other ports of the same
        # link layer and speed is a degraded link (its siblings say what the cables carry).
        for p in active:
            peers = [q for q in active if q["speed"] == p["speed"] and q["link_layer"] == p["link_layer"]]
            widest = max(_width_n(q["width"]) for q in peers)
            if 0 < _width_n(p["width"]) < widest:
                warns.append(f"{p['port']} width {p['width']} < {widest}X of the node's other "
                             f"{p['speed'] or ''} ports (degraded link?)".replace("  ", " "))
    if min_ports and len(active) < min_ports:
        fails.append(f"{len(active)} ACTIVE ports < {min_ports}")
    if cfg.get("required") and not ports and not missing:
        fails.append("no port judged")
    threshold = {"expected_rate_gbps": expected_rate, "expected_width": expected_width, "min_ports": min_ports,
                 "ports": list(cfg.get("ports") or ())}
    data, scope = _listing(ports, reported)
    if fails:
        return ProbeResult("fabric.ports", "fail", value=len(active), unit="ports", threshold=threshold, data=data,
                           detail="; ".join(fails[:4]) + (f" and {len(fails) - 4} more" if len(fails) > 4 else "")
                           + "; reseat or replace the cable/transceiver, check the switch port (ibstat, mlxlink)"
                           + f" [{scope}]")
    if warns:
        hint = "; set expected_width to make it a failure" if any("degraded link?" in w for w in warns) else ""
        return ProbeResult("fabric.ports", "warn", value=len(active), unit="ports", threshold=threshold, data=data,
                           detail="; ".join(warns[:4]) + hint + f" [{scope}]")
    if not ports:
        return ProbeResult("fabric.ports", "skip", value=0, unit="ports", threshold=threshold, data=data,
                           detail=f"no port judged [{scope}]")
    rates = sorted({p["rate"] for p in active})
    return ProbeResult("fabric.ports", "pass", value=len(active), unit="ports", threshold=threshold, data=data,
                       detail=f"{len(active)} ports ACTIVE ({', '.join(rates)}) [{scope}]")


def counter_rises(ports: List[Dict[str, Any]], prev: Mapping[str, Any], now: float) -> Tuple[
        List[Dict[str, Any]], List[str]]:
    """(rises since the saved values, saturated counters) for each port's counters.

    ``prev`` is the saved ``{"port": {"counter": value}}``; a port or counter not in it
    has no baseline yet (no rise). A value below the saved one was reset: it is the rise.
    """
    rises: List[Dict[str, Any]] = []
    saturated: List[str] = []
    for p in ports:
        before = prev.get(p["port"]) if isinstance(prev.get(p["port"]), dict) else None
        for name, value in p["counters"].items():
            top = (1 << COUNTER_BITS[name]) - 1
            if value >= top:
                saturated.append(f"{p['port']} {name}")
            if before is None or not isinstance(before.get(name), int):
                continue
            rise = value - before[name] if value >= before[name] else value
            if rise > 0:
                rises.append({"t": now, "port": p["port"], "counter": name, "rise": rise})
    return rises, saturated


def _in_window(events: Sequence[Mapping[str, Any]], now: float, window_h: float) -> List[Mapping[str, Any]]:
    since = now - window_h * 3600.0
    return [e for e in events if isinstance(e, dict) and isinstance(e.get("t"), (int, float)) and e["t"] >= since]


def _sum_by(events: Sequence[Mapping[str, Any]], *keys: str) -> Dict[Tuple, int]:
    out: Dict[Tuple, int] = {}
    for e in events:
        k = tuple(e.get(x) for x in keys)
        out[k] = out.get(k, 0) + int(e.get("rise", 0))
    return out


def rule_errors(events: Sequence[Mapping[str, Any]], saturated: Sequence[str], cfg: Mapping[str, Any],
                baseline: bool) -> ProbeResult:
    """Rises of the error counters within the window against ``counters: {name: {warn, fail}}``."""
    window_h = float(cfg.get("window_h", 24))
    limits = cfg.get("counters") or {}
    errors = [e for e in events if e.get("counter") != FLAP_COUNTER]
    by_counter = _sum_by(errors, "counter")
    by_port = _sum_by(errors, "port", "counter")
    total = sum(by_counter.values())
    fails, warns = [], []
    for (name,), n in sorted(by_counter.items()):
        lim = limits.get(name) or {}
        worst_port = max((k for k in by_port if k[1] == name), key=lambda k: by_port[k])[0]
        text = f"{name} +{n} in {window_h:g} h (most on {worst_port})"
        if lim.get("fail") is not None and n >= lim["fail"]:
            fails.append(f"{text} >= {lim['fail']}")
        elif lim.get("warn") is not None and n >= lim["warn"]:
            warns.append(f"{text} >= {lim['warn']}")
    data = {"window_h": window_h, "rises": {f"{p}:{c}": n for (p, c), n in sorted(by_port.items())},
            "saturated": list(saturated)}
    threshold = {k: dict(v) for k, v in limits.items() if isinstance(v, dict)}
    if fails:
        return ProbeResult("fabric.errors", "fail", value=total, unit="errors", threshold=threshold, data=data,
                           detail="; ".join(fails[:3]) + "; check the cable and the switch port (mlxlink -c), "
                           "replace the cable if it recurs")
    if warns or saturated:
        parts = warns[:3] + ([f"counter saturated, rises invisible: {', '.join(saturated[:3])}; reset it "
                              "(perfquery -x)"] if saturated else [])
        return ProbeResult("fabric.errors", "warn", value=total, unit="errors", threshold=threshold, data=data,
                           detail="; ".join(parts))
    if baseline:
        return ProbeResult("fabric.errors", "pass", value=0, unit="errors", threshold=threshold, data=data,
                           detail="first check on this node: counters recorded as the baseline")
    return ProbeResult("fabric.errors", "pass", value=total, unit="errors", threshold=threshold, data=data,
                       detail=f"{total} counted errors in {window_h:g} h, under the limits")


def rule_flaps(events: Sequence[Mapping[str, Any]], cfg: Mapping[str, Any]) -> ProbeResult:
    """Rises of link_downed within the window: warn from ``flaps_warn``, fail from ``flaps_fail``."""
    window_h = float(cfg.get("window_h", 24))
    warn_at, fail_at = cfg.get("flaps_warn", 1), cfg.get("flaps_fail", 5)
    by_port = _sum_by([e for e in events if e.get("counter") == FLAP_COUNTER], "port")
    n = sum(by_port.values())
    threshold = {"warn": warn_at, "fail": fail_at, "window_h": window_h}
    data = {"per_port": {k[0]: v for k, v in sorted(by_port.items())}}
    where = ", ".join(f"{k[0]} x{v}" for k, v in sorted(by_port.items(), key=lambda kv: -kv[1])[:3])
    if fail_at is not None and n >= fail_at:
        return ProbeResult("fabric.flaps", "fail", value=n, unit="flaps", threshold=threshold, data=data,
                           detail=f"{n} link flaps in {window_h:g} h >= {fail_at} ({where}); replace the cable "
                                  "or transceiver, check the switch port")
    if warn_at is not None and n >= warn_at:
        return ProbeResult("fabric.flaps", "warn", value=n, unit="flaps", threshold=threshold, data=data,
                           detail=f"{n} link flaps in {window_h:g} h ({where}); watch the port")
    return ProbeResult("fabric.flaps", "pass", value=n, unit="flaps", threshold=threshold, data=data,
                       detail=f"no link flaps in {window_h:g} h")


def evaluate(ports: List[Dict[str, Any]], saved: Dict[str, Any], cfg: Mapping[str, Any],
             now: float) -> List[ProbeResult]:
    """The three results from this check's ports and the saved state, which is updated in
    place (new counter values, the rises in the window). Pure but for ``saved``."""
    judged, reported, missing = split_ports(ports, cfg)
    prev = saved.get("counters") if isinstance(saved.get("counters"), dict) else {}
    rises, saturated = counter_rises(judged, prev, now)
    window_h = float(cfg.get("window_h", 24))
    events = _in_window(list(saved.get("events") or []) + rises, now, window_h)[-MAX_EVENTS:]
    saved["counters"] = {p["port"]: dict(p["counters"]) for p in judged}
    saved["events"] = events
    saved["time"] = now
    results = [rule_ports(judged, cfg, reported, missing)]
    if any(p["counters"] for p in judged):
        results.append(rule_errors(events, saturated, cfg, baseline=not prev))
        results.append(rule_flaps(events, cfg))
    return results


def probe_fabric(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    root = Path(cfg.get("sys_root") or "/sys/class/infiniband")
    ports = read_ports(root)
    layers = cfg.get("link_layers") or LINK_LAYERS
    if not ports:
        if cfg.get("required") or cfg.get("min_ports") or cfg.get("ports"):
            return [ProbeResult("fabric.ports", "fail", value=0, unit="ports", threshold=cfg.get("min_ports") or 1,
                                detail=f"no {'/'.join(layers)} ports under {root}; check the HCA driver "
                                       "(ibstat, rdma link)")]
        return [ProbeResult("fabric.ports", "skip", value=0, unit="ports",
                            detail=f"no InfiniBand/RoCE ports under {root} (no HCA, or sysfs not mounted)")]
    path = Path(cfg["state_file"]) if cfg.get("state_file") else \
        local_state.default_state_file(ctx.state_dir, ctx.env, ctx.node, "fabric")
    now = time.time()
    try:
        return local_state.update(path, lambda saved: evaluate(ports, saved, cfg, now))
    except OSError as e:
        judged, reported, missing = split_ports(ports, cfg)
        return [rule_ports(judged, cfg, reported, missing), ProbeResult("fabric.errors", "error",
                            detail=f"cannot keep the fabric counters in {path}: {e.strerror or e}; "
                                   "set CLUSTEROPS_STATE_DIR to a writable directory")]
