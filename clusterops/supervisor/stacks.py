"""Capture the Python stacks of a job step's ranks on this node (run by the supervisor
through ``srun --overlap`` on the node of a hung rank).

    python -m clusterops.supervisor.stacks --job 12 --step 0 --ranks 1,2

Finds the step's processes by their environment (SLURM_JOB_ID, SLURM_STEP_ID,
SLURM_PROCID), then prints ``py-spy dump --nonblocking`` for each (nonblocking: a
stopped or wedged process is read, never paused or resumed). Without py-spy it prints
what the kernel says (state, wchan, kernel stack) so the report is never empty.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Dict, List, Optional

from clusterops.runner import CommandError, CommandTimeout, Runner


def _environ(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def find_rank_pids(job: str, step: Optional[str], ranks: List[int]) -> Dict[int, List[int]]:
    found: Dict[int, List[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        env = _environ(pid)
        if env.get("SLURM_JOB_ID") != job or (step and env.get("SLURM_STEP_ID") != step):
            continue
        try:
            rank = int(env.get("SLURM_PROCID", "-1"))
        except ValueError:
            continue
        if ranks and rank not in ranks:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "python" in cmd:
            found.setdefault(rank, []).append(pid)
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"({e.strerror})"


def proc_state(pid: int) -> str:
    """The kernel's word on a process (``/proc/<pid>/status``'s State, "T (stopped)" for one
    held by SIGSTOP): evidence py-spy's stack alone does not give."""
    for ln in _read(f"/proc/{pid}/status").splitlines():
        if ln.startswith("State:"):
            return ln.split(":", 1)[1].strip()
    return "unknown"


def dump(pid: int, timeout_s: float = 15.0) -> str:
    pyspy = shutil.which("py-spy") or (os.path.join(os.path.dirname(sys.executable), "py-spy"))
    if pyspy and os.path.exists(pyspy):
        try:
            p = Runner().run([pyspy, "dump", "--nonblocking", "--pid", str(pid)], timeout_s=timeout_s,
                             check=False)
            return p.stdout + (p.stderr if p.returncode else "")
        except CommandTimeout:
            return "py-spy dump timed out\n"
        except CommandError as e:   # could not start it at all
            return f"py-spy dump failed: {e.message}\n"
    state = [ln for ln in _read(f"/proc/{pid}/status").splitlines() if ln.startswith(("State:", "Name:"))]
    return ("py-spy not installed (pip install py-spy for Python stacks); kernel view:\n"
            + "\n".join(state) + f"\nwchan: {_read(f'/proc/{pid}/wchan')}\n"
            + f"kernel stack:\n{_read(f'/proc/{pid}/stack')}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="dump the Python stacks of a Slurm step's ranks on this node")
    p.add_argument("--job", required=True)
    p.add_argument("--step", default="")
    p.add_argument("--ranks", default="")
    a = p.parse_args(argv)
    ranks = [int(r) for r in a.ranks.split(",") if r.strip()]
    found = find_rank_pids(a.job, a.step or None, ranks)
    if not found:
        print(f"no processes of job {a.job} step {a.step or '?'} ranks {ranks} on this node")
        return 1
    for rank, pids in sorted(found.items()):
        for pid in pids:
            print(f"=== rank {rank} pid {pid} state {proc_state(pid)} ===")
            print(dump(pid))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
