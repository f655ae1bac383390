"""XID probe: NVIDIA Xid events in the kernel log since the last check.

The driver logs GPU faults as kernel messages (format from the NVIDIA Xid catalog,
docs.nvidia.com/deploy/xid-errors):

    [ 8421.337190] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.

The probe reads the log (``dmesg``, else ``journalctl -k``, or a file given in the
profile), keeps the boot id and the timestamp of the last message it has seen in a
state file, and classifies only the new events. Warning-class events are reported once.
Failure-class events stay open (the probe keeps failing) until the node reboots (a new
boot id) or an administrator acknowledges them (``clusterops health xid-ack``) after the
GPU reset; otherwise a drained node would be resumed by the next check although its GPU
was never fixed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from clusterops.fsutil import read_regular_text
from clusterops.health.probes import state as local_state
from clusterops.health.probes.base import ProbeContext, ProbeResult
from clusterops.runner import CommandError

# code -> (status, action, what it means). From the NVIDIA Xid catalog and the
# ml-engineering book's GPU troubleshooting notes; codes not listed are "warn".
XID_TABLE: Dict[int, Tuple[str, str, str]] = {
    13: ("warn", "check the job", "graphics engine exception (usually an application bug)"),
    31: ("warn", "check the job", "GPU memory page fault (usually an application bug)"),
    43: ("warn", "check the job", "GPU stopped processing (usually an application bug)"),
    45: ("warn", "none", "preemptive cleanup after earlier errors"),
    48: ("fail", "reset", "double-bit ECC error; RMA if it recurs"),
    61: ("fail", "reset", "internal micro-controller breakpoint/warning"),
    62: ("fail", "reset", "internal micro-controller halt"),
    63: ("warn", "reset", "ECC page retirement / row remap recorded; reset when idle to apply"),
    64: ("fail", "RMA", "ECC page retirement / row remapper recording failure"),
    74: ("fail", "reset", "NVLink error; check the link, RMA if it recurs"),
    79: ("fail", "reboot", "GPU has fallen off the bus; RMA if it recurs"),
    92: ("warn", "watch", "high single-bit ECC error rate; RMA if it persists"),
    94: ("warn", "reset", "contained ECC error; the affected job was stopped, reset when idle"),
    95: ("fail", "reset", "uncontained ECC error"),
    109: ("warn", "check the job", "context switch timeout"),
    119: ("fail", "reboot", "GSP RPC timeout; update the driver if it recurs"),
    120: ("fail", "reboot", "GSP error"),
    140: ("fail", "reset", "unrecovered ECC error"),
}

#: How much of a kernel log file (``log_file``) is read: its last 8 MiB, many days of a
#: busy node's kernel messages. A check runs every few minutes; older events were seen before.
LOG_MAX_BYTES = 8 << 20
BOOT_ID_MAX_BYTES = 4096

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([^)]*)\): (\d+),\s*(.*)$")
_TS = re.compile(r"^\s*\[\s*(\d+(?:\.\d+)?)\]")


def classify(code: int) -> Tuple[str, str, str]:
    return XID_TABLE.get(code, ("warn", "look it up", f"Xid {code} (see the NVIDIA Xid catalog)"))


def parse_log(text: str) -> List[Dict[str, Any]]:
    """Kernel log lines (dmesg or ``journalctl -o short-monotonic``) -> Xid events in order."""
    events = []
    for line in text.splitlines():
        m = _XID.search(line)
        if not m:
            continue
        ts = _TS.match(line)
        code = int(m.group(2))
        status, action, meaning = classify(code)
        events.append({"ts": float(ts.group(1)) if ts else None, "pci": m.group(1), "code": code,
                       "status": status, "action": action, "meaning": meaning,
                       "message": m.group(3).strip()[:200]})
    return events


def _boot_id(cfg: Dict[str, Any]) -> str:
    try:
        return read_regular_text(cfg.get("boot_id_file", "/proc/sys/kernel/random/boot_id"), BOOT_ID_MAX_BYTES).strip()
    except OSError:
        return "unknown"


def default_state_file(ctx: ProbeContext) -> Path:
    return local_state.default_state_file(ctx.state_dir, ctx.env, ctx.node, "xid")


_load_state = local_state.load_state
_save_state = local_state.save_state


def read_kernel_log(cfg: Dict[str, Any], ctx: ProbeContext) -> Tuple[Optional[str], str]:
    """(text or None, where it came from)."""
    source = cfg.get("source", "auto")
    if cfg.get("log_file") or source == "file":
        p = cfg.get("log_file")
        try:
            # The tail: new events are at the end, and a log that grew to gigabytes (or
            # /dev/zero, a FIFO named by mistake) must not hang the check or eat memory.
            return read_regular_text(p, LOG_MAX_BYTES, tail=True), f"file {p}"
        except OSError as e:
            return None, f"file {p}: {e.strerror}"
    tries = []
    if source in ("auto", "dmesg"):
        tries.append(("dmesg", ["dmesg"]))
    if source in ("auto", "journal"):
        tries.append(("journal", ["journalctl", "-k", "-b", "-o", "short-monotonic", "--no-pager", "-q"]))
    why = []
    for name, argv in tries:
        try:
            out = ctx.runner.run(argv, timeout_s=float(cfg.get("read_timeout_s", 5))).stdout
        except CommandError as e:
            why.append(f"{name}: {e}")
            continue
        if out.strip() or name == tries[-1][0]:
            return out, name
        why.append(f"{name}: empty")
    return None, "; ".join(why)


def ack(state_file: Path) -> int:
    """Close every open failure-class event (after the GPU was reset). Returns how many."""
    state = _load_state(state_file)
    n = len(state.get("open", []))
    state["open"] = []
    _save_state(state_file, state)
    return n


def probe_xid(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    state_file = Path(cfg["state_file"]) if cfg.get("state_file") else default_state_file(ctx)
    text, where = read_kernel_log(cfg, ctx)
    if text is None:
        status = "warn" if ctx.gpus_required else "skip"
        return [ProbeResult("xid", status, detail=f"kernel log unreadable ({where}); run as root or "
                                                   "allow dmesg (kernel.dmesg_restrict=0)")]
    events = parse_log(text)
    boot = _boot_id(cfg)
    state = _load_state(state_file)
    if state.get("boot_id") != boot:
        state = {"boot_id": boot, "last_ts": -1.0, "open": []}  # a reboot clears open events
    last = float(state.get("last_ts", -1.0))
    new = [e for e in events if e["ts"] is None or e["ts"] > last]
    # Timestamps in the log are seconds since boot: keep the newest one seen.
    seen = [e["ts"] for e in events if e["ts"] is not None]
    stamps = [float(m.group(1)) for m in (_TS.match(l) for l in text.splitlines()[-5:]) if m]
    state["last_ts"] = max([last] + seen + stamps)
    state["open"] = (state.get("open") or []) + [e for e in new if e["status"] == "fail"]
    state["open"] = state["open"][-50:]
    try:
        _save_state(state_file, state)
    except OSError as e:
        return [ProbeResult("xid", "error", detail=f"cannot write state file {state_file}: {e.strerror}")]

    open_fail = state["open"]
    warn_new = [e for e in new if e["status"] == "warn"]
    data = {"source": where, "state_file": str(state_file), "new_events": new[-20:], "open": open_fail}
    if open_fail:
        worst_action = _worst_action(open_fail)
        codes = _summ(open_fail)
        return [ProbeResult("xid", "fail", value=len(open_fail), unit="events", threshold=0, data=data,
                            detail=f"{codes}: {worst_action} (then `clusterops health xid-ack` if not rebooted)")]
    if warn_new:
        return [ProbeResult("xid", "warn", value=len(warn_new), unit="events", threshold=0, data=data,
                            detail=f"{_summ(warn_new)}: {warn_new[-1]['action']}")]
    return [ProbeResult("xid", "pass", value=0, unit="events", threshold=0, data=data,
                        detail=f"no new Xid events ({where})")]


_ACTION_ORDER = ["RMA", "reboot", "reset"]


def _worst_action(events: List[Dict[str, Any]]) -> str:
    actions = {e["action"] for e in events}
    for a in _ACTION_ORDER:
        if a in actions:
            return {"RMA": "RMA the GPU", "reboot": "reboot the node", "reset": "reset the GPU"}[a]
    return "check the GPU"


def _summ(events: List[Dict[str, Any]]) -> str:
    parts = []
    for e in events[-3:]:
        parts.append(f"Xid {e['code']} on {e['pci']} ({e['meaning']})")
    more = f" and {len(events) - 3} more" if len(events) > 3 else ""
    return "; ".join(parts) + more
