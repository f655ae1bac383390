"""Host probes: disk space and inodes, mounts, memory, InfiniBand ports, CPUs, stray processes.

Anything that can block in the kernel (statvfs or a write on a dead NFS mount) runs in
a short-lived child process through the Runner, with its own timeout, so the check
process never sits in an uninterruptible wait itself.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from clusterops.fsutil import read_regular
from clusterops.health.probes.base import ProbeContext, ProbeResult
from clusterops.runner import CommandError, CommandTimeout

_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")

# Run in a child: statvfs, then (optionally) write, fsync and remove a small file.
_PATH_CHECK = r"""
import json, os, sys
p, write = sys.argv[1], sys.argv[2] == "1"
out = {}
try:
    st = os.statvfs(p)
    out.update(free_bytes=st.f_bavail * st.f_frsize, total_bytes=st.f_blocks * st.f_frsize,
               free_inodes=st.f_favail, total_inodes=st.f_files)
except OSError as e:
    out["error"] = f"statvfs: {e.strerror}"
    print(json.dumps(out)); sys.exit(0)
if write:
    f = os.path.join(p, f".clusterops-health-{os.getpid()}")
    try:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            try:
                os.unlink(f)
            except OSError:
                pass
        out["writable"] = True
    except OSError as e:
        out["writable"] = False
        out["write_error"] = e.strerror
print(json.dumps(out))
"""


class UnsetVariable(ValueError):
    pass


def expand(path: str, env: Mapping[str, str]) -> str:
    """Expand ``$VAR``/``${VAR}`` from env; an unset or empty variable is an error
    (``${CLUSTEROPS_NODE_SCRATCH}`` unset must not silently become ``/``)."""

    def sub(m: "re.Match[str]") -> str:
        name = m.group(1) or m.group(2)
        val = env.get(name)
        if not val:
            raise UnsetVariable(name)
        return val

    return os.path.expanduser(_VAR.sub(sub, str(path)))


def _gb(n_bytes: float) -> float:
    return round(n_bytes / 1e9, 3)


def _check_path(ctx: ProbeContext, path: str, write: bool, timeout_s: float) -> Dict[str, Any]:
    argv = [sys.executable, "-I", "-S", "-c", _PATH_CHECK, path, "1" if write else "0"]
    try:
        done = ctx.runner.run(argv, timeout_s=timeout_s, check=False)
    except CommandTimeout:
        return {"error": f"no answer within {timeout_s:g}s (dead or hung mount?)", "hung": True}
    except CommandError as e:
        return {"error": str(e)}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"path check failed: {done.stderr.strip()[-200:]}"}


def probe_paths(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    """``paths: [{path, min_free_gb, min_free_inodes, writable}]`` -> one result per path."""
    results: List[ProbeResult] = []
    timeout_s = float(cfg.get("path_timeout_s", 5))
    for item in cfg.get("paths") or []:
        raw = item["path"]
        name = f"host.path:{raw}"
        min_gb = float(item.get("min_free_gb", 0))
        min_inodes = int(item.get("min_free_inodes", 0))
        threshold = {"min_free_gb": min_gb, "min_free_inodes": min_inodes}
        try:
            path = expand(raw, ctx.env)
        except UnsetVariable as e:
            results.append(ProbeResult(name, "fail", threshold=threshold,
                                       detail=f"{raw}: environment variable {e} is not set; "
                                              "fix the node's environment or the profile"))
            continue
        if not os.path.isdir(path):
            what = "missing" if not os.path.lexists(path) else "not a directory"
            results.append(ProbeResult(name, "fail", threshold=threshold, data={"path": path},
                                       detail=f"{path} is {what}; recreate or remount it"))
            continue
        r = _check_path(ctx, path, bool(item.get("writable", True)), timeout_s)
        data = dict(r, path=path)
        if "error" in r:
            results.append(ProbeResult(name, "fail", threshold=threshold, data=data,
                                       detail=f"{path}: {r['error']}; check the filesystem"))
            continue
        free_gb = _gb(r["free_bytes"])
        problems = []
        if free_gb < min_gb:
            problems.append(f"{free_gb:g} GB free < {min_gb:g} GB")
        if r["total_inodes"] and r["free_inodes"] < min_inodes:
            problems.append(f"{r['free_inodes']} inodes free < {min_inodes}")
        if r.get("writable") is False:
            problems.append(f"not writable ({r.get('write_error')})")
        if problems:
            detail = f"{path}: " + ", ".join(problems) + "; free space (clean old job files) or fix the mount"
            status = "fail"
        else:
            detail = f"{path}: {free_gb:g} GB and {r['free_inodes']} inodes free"
            status = "pass"
        results.append(ProbeResult(name, status, value=free_gb, unit="GB", threshold=threshold,
                                   detail=detail, data=data))
    return results


def read_mounts(text: str) -> Dict[str, Tuple[str, str]]:
    """/proc/self/mounts text -> {mountpoint: (fstype, source)} (octal escapes decoded)."""
    out: Dict[str, Tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        out[mp] = (parts[2], parts[0])
    return out


# Files a profile can name (mounts_file, meminfo_file, the sysfs tree under sys_root) are read
# with a size bound, regular files only (clusterops.fsutil.read_regular): /dev/zero or a FIFO
# named by mistake is an error result, not a hung or memory-eating check.
MOUNTS_MAX_BYTES = 16 << 20     # a container host with thousands of mounts stays far below
MEMINFO_MAX_BYTES = 64 << 10
SYSFS_MAX_BYTES = 4096


def _read_whole(path, max_bytes: int) -> str:
    """A file read in full, or ValueError if it is larger than a real one could be."""
    raw, cut = read_regular(path, max_bytes)
    if cut:
        raise ValueError(f"larger than {max_bytes} bytes; not a {Path(path).name} file")
    return raw.decode("utf-8")


def _read_sys(path: Path) -> str:
    """One sysfs attribute ("" when absent or unreadable)."""
    try:
        return read_regular(path, SYSFS_MAX_BYTES)[0].decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def probe_mounts(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    """``mounts: [{path, fstype, writable}]``: mounted (exactly there), right type, writable in time."""
    results: List[ProbeResult] = []
    mounts_file = cfg.get("mounts_file", "/proc/self/mounts")
    try:
        table = read_mounts(_read_whole(mounts_file, MOUNTS_MAX_BYTES))
    except (OSError, ValueError) as e:
        return [ProbeResult("host.mounts", "error", detail=f"cannot read {mounts_file}: "
                                                           f"{getattr(e, 'strerror', None) or e}")]
    timeout_s = float(cfg.get("path_timeout_s", 5))
    for item in cfg.get("mounts") or []:
        raw = item["path"] if isinstance(item, dict) else str(item)
        item = item if isinstance(item, dict) else {"path": raw}
        name = f"host.mount:{raw}"
        try:
            path = expand(raw, ctx.env).rstrip("/") or "/"
        except UnsetVariable as e:
            results.append(ProbeResult(name, "fail", detail=f"{raw}: environment variable {e} is not set"))
            continue
        if path not in table:
            results.append(ProbeResult(name, "fail", value=False, threshold="mounted",
                                       detail=f"{path} is not mounted; mount it (check fstab/automount) "
                                              "before returning the node"))
            continue
        fstype, source = table[path]
        want = item.get("fstype")
        if want and fstype != want:
            results.append(ProbeResult(name, "fail", value=fstype, threshold=want,
                                       detail=f"{path} is {fstype} from {source}, expected {want}; remount it"))
            continue
        r = _check_path(ctx, path, bool(item.get("writable", True)), timeout_s)
        data = dict(r, path=path, fstype=fstype, source=source)
        if "error" in r or r.get("writable") is False:
            why = r.get("error") or f"not writable ({r.get('write_error')})"
            results.append(ProbeResult(name, "fail", value=False, threshold="mounted, writable", data=data,
                                       detail=f"{path} ({fstype}): {why}; fix or remount it"))
        else:
            results.append(ProbeResult(name, "pass", value=True, threshold="mounted, writable", data=data,
                                       detail=f"{path} mounted ({fstype} from {source}) and writable"))
    return results


def probe_memory(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    min_gb = float(cfg.get("min_available_gb", 0))
    meminfo_file = cfg.get("meminfo_file", "/proc/meminfo")
    try:
        meminfo = _read_whole(meminfo_file, MEMINFO_MAX_BYTES)
    except (OSError, ValueError) as e:
        return [ProbeResult("host.memory", "error", detail=f"cannot read {meminfo_file}: "
                                                           f"{getattr(e, 'strerror', None) or e}")]
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    t = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M)
    if not m:
        return [ProbeResult("host.memory", "error", detail="no MemAvailable in /proc/meminfo")]
    avail = round(int(m.group(1)) * 1024 / 1e9, 2)
    total = round(int(t.group(1)) * 1024 / 1e9, 2) if t else None
    ok = avail >= min_gb
    return [ProbeResult("host.memory", "pass" if ok else "fail", value=avail, unit="GB", threshold=min_gb,
                        data={"total_gb": total},
                        detail=(f"{avail:g} GB of {total:g} GB available" if ok else
                                f"only {avail:g} GB available < {min_gb:g} GB; look for leftover "
                                "processes or a full /dev/shm, reboot if it persists"))]


def probe_cpus(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    want = cfg.get("min_cpus")
    n = os.cpu_count() or 0
    if not want:
        return [ProbeResult("host.cpus", "pass", value=n, unit="cpus", detail=f"{n} CPUs online")]
    ok = n >= int(want)
    return [ProbeResult("host.cpus", "pass" if ok else "fail", value=n, unit="cpus", threshold=int(want),
                        detail=(f"{n} CPUs online" if ok else
                                f"{n} CPUs online < {want}: CPUs offline or hyperthreading changed; "
                                "check BIOS/kernel cmdline"))]


def _rate_gbps(text: str) -> Optional[float]:
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else None


def probe_infiniband(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    """Every port under /sys/class/infiniband: state ACTIVE, physical state LinkUp, rate as expected."""
    root = Path(cfg.get("sys_root", "/sys/class/infiniband"))
    required = bool(cfg.get("required", False))
    expected = cfg.get("expected_rate_gbps")
    min_ports = int(cfg.get("min_ports", 0) or 0)
    ports = sorted(root.glob("*/ports/*")) if root.is_dir() else []
    if not ports:
        if required or min_ports:
            return [ProbeResult("host.infiniband", "fail", value=0, unit="ports", threshold=min_ports or 1,
                                detail=f"no InfiniBand ports under {root}; check the HCA driver (ibstat)")]
        return [ProbeResult("host.infiniband", "skip", value=0, unit="ports", detail="no InfiniBand devices")]
    bad: List[str] = []
    per_port: Dict[str, Any] = {}
    active = 0
    for p in ports:
        dev, port = p.parent.parent.name, p.name
        key = f"{dev}/{port}"
        read = lambda f: _read_sys(p / f)  # noqa: E731
        state, phys, rate = read("state"), read("phys_state"), read("rate")
        link = read("link_layer") or "InfiniBand"
        per_port[key] = {"state": state, "phys_state": phys, "rate": rate, "link_layer": link}
        if cfg.get("infiniband_only", True) and link != "InfiniBand":
            continue  # RoCE/Ethernet ports are not held to IB rules
        if "ACTIVE" not in state:
            bad.append(f"{key} {state.split(':')[-1].strip() or 'unknown'}")
            continue
        active += 1
        r = _rate_gbps(rate)
        if expected and (r is None or r < float(expected)):
            bad.append(f"{key} at {rate or 'unknown rate'} < {expected} Gb/sec")
    if min_ports and active < min_ports:
        bad.append(f"{active} active ports < {min_ports}")
    if bad:
        return [ProbeResult("host.infiniband", "fail", value=active, unit="ports",
                            threshold={"expected_rate_gbps": expected, "min_ports": min_ports}, data=per_port,
                            detail="; ".join(bad) + "; reseat/replace the cable or check the switch port")]
    return [ProbeResult("host.infiniband", "pass", value=active, unit="ports",
                        threshold={"expected_rate_gbps": expected, "min_ports": min_ports}, data=per_port,
                        detail=f"{active} ports ACTIVE")]


_JOB_KEYS = (b"SLURM_JOB_ID", b"SLURMD_NODENAME", b"SLURM_JOBID")
_STEPD = re.compile(r"slurmstepd: \[(\d+)")


def _proc_env(pid: int, proc_root: str = "/proc") -> Dict[str, str]:
    try:
        raw = Path(proc_root, str(pid), "environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k in _JOB_KEYS:
            env[k.decode()] = v.decode(errors="replace")
    return env


def _parent(pid: int, proc_root: str = "/proc") -> int:
    stat = Path(proc_root, str(pid), "stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _ancestors(pid: int, proc_root: str = "/proc") -> set:
    out = set()
    while pid > 1:
        out.add(pid)
        try:
            pid = _parent(pid, proc_root)
        except (OSError, ValueError, IndexError):
            break
    return out


def job_of_process(pid: int, proc_root: str = "/proc") -> Optional[str]:
    """The Slurm job a process belongs to, or None: SLURM_JOB_ID in its environment, else
    the job of the ``slurmstepd: [JOB.STEP]`` it descends from (a task that cleared its
    environment is still the step's). This is the one /proc scan for job ownership."""
    env = _proc_env(pid, proc_root)
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if job:
        return job
    p, hops = pid, 0
    while p > 1 and hops < 64:
        try:
            cmd = Path(proc_root, str(p), "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            m = _STEPD.match(cmd)
            if m:
                return m.group(1)
            p = _parent(p, proc_root)
        except (OSError, ValueError, IndexError):
            return None
        hops += 1
    return None


def find_job_processes(node: str, *, proc_root: str = "/proc", conf: Optional[str] = None) -> Dict[int, str]:
    """pid -> SLURM_JOB_ID for processes of Slurm jobs on this node (own ancestry excluded);
    ``conf``: the Slurm configuration they must name (default $SLURM_CONF)."""
    mine = _ancestors(os.getpid(), proc_root)
    conf = conf or os.environ.get("SLURM_CONF")
    out: Dict[int, str] = {}
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in mine:
            continue
        env = _proc_env(pid, proc_root)
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        # On a shared dev host several slurmd run side by side; keep this node's only, and
        # of this Slurm only (two clusters on one host both have a "node1").
        if job and env.get("SLURMD_NODENAME", node) == node and _same_slurm(env, conf):
            out[pid] = job
    return out


def _same_slurm(env: Dict[str, str], conf: Optional[str]) -> bool:
    """Whether a job process belongs to the Slurm this check asks (its SLURM_CONF, where
    both name one: slurmstepd exports it to every task)."""
    theirs = env.get("SLURM_CONF")
    return not (conf and theirs) or os.path.realpath(theirs) == os.path.realpath(conf)


def probe_stray_processes(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    """Processes that belong to Slurm jobs no longer running on this node."""
    status_if_found = cfg.get("status", "warn")
    procs = find_job_processes(ctx.node, proc_root=os.path.join(ctx.host_root, "proc"),
                               conf=ctx.env.get("SLURM_CONF"))
    if not procs:
        return [ProbeResult("host.stray_processes", "pass", value=0, unit="processes",
                            detail="no processes of Slurm jobs on this node")]
    try:
        from clusterops.slurm.factory import connect

        slurm = connect(timeout_s=float(cfg.get("slurm_timeout_s", 3)), read_attempts=1)
        # Anything not finished counts as live (a completing job still owns its processes).
        # Ask about these jobs only (not the whole queue: thousands of nodes run this).
        ids = sorted({int(j) for j in procs.values() if j.isdigit()})
        active = {str(j.job_id) for j in slurm.jobs(ids) if j.category not in ("done", "failed")}
    except Exception as e:  # controller down, or not a Slurm node: cannot tell stray from live
        return [ProbeResult("host.stray_processes", "skip", value=len(procs), unit="processes",
                            detail=f"cannot list active jobs ({type(e).__name__}); not judged")]
    own = ctx.env.get("SLURM_JOB_ID")
    stray = {pid: job for pid, job in procs.items() if job not in active and job != own}
    if not stray:
        return [ProbeResult("host.stray_processes", "pass", value=0, unit="processes",
                            detail=f"{len(procs)} job processes, all of active jobs")]
    jobs = sorted(set(stray.values()))
    pids = sorted(stray)[:10]
    return [ProbeResult("host.stray_processes", status_if_found, value=len(stray), unit="processes",
                        threshold=0, data={"pids": sorted(stray), "jobs": jobs},
                        detail=f"{len(stray)} processes of finished jobs {','.join(jobs)} "
                               f"(pids {' '.join(map(str, pids))}); kill them")]


def probe_host(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    """All host checks in one call (for library users; the profile runs them as separate probes)."""
    out: List[ProbeResult] = []
    for fn in (probe_paths, probe_mounts, probe_memory, probe_cpus, probe_infiniband):
        out.extend(fn(cfg, ctx))
    return out


__all__ = ["probe_paths", "probe_mounts", "probe_memory", "probe_cpus", "probe_infiniband",
           "probe_stray_processes", "probe_host", "expand", "read_mounts", "job_of_process"]
