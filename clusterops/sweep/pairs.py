"""Node pairs: a 2-node all-reduce on pairs of healthy nodes (``sweep --pairs``).

A node can pass its own check and still sit behind a bad link; pairing healthy nodes
two by two, each pair one exclusive 2-node Slurm job running ``clusterops health dist``
under ``srun`` (the step argv from ``clusterops.slurm.steps.srun_argv``, the script from
``templates/sweep/pair.sh.j2``), shows the link. Results are read from per-job files as
in the check fan-out; a pair without a result in time is ``unreachable`` and its job
cancelled.

The same job then runs ``clusterops health ibbw --profile P`` as a second step over the pair
(:mod:`clusterops.health.probes.ibbw`: ``ib_write_bw`` from node 0 to node 1 on every rail,
with the profile's ``probes.ibbw`` settings: GPUDirect where it says so, as ``preflight`` and
``deep`` do): its result is the pair's ``ib_write_bw`` entry. A skip there (no ``ib_write_bw``, no HCA)
leaves the pair's status as the all-reduce made it; a fail there makes the pair fail.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Tuple

from clusterops.errors import ClusteropsError
from clusterops.health.probes import ibbw
from clusterops.sweep import scripts
from clusterops.sweep.options import SweepOptions
from clusterops.sweep.results import NodeResult, natural_key, one_line


def run_pairs(slurm, results: Mapping[str, NodeResult], opts: SweepOptions, work: Path,
              errors: List[str], *, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> List[dict]:
    """2-node all-reduce on pairs of healthy nodes (``clusterops health dist``), so a bad
    link shows up, not only a bad node. Each pair is one 2-node exclusive job."""
    from clusterops.slurm.steps import srun_argv   # not at import: the Slurm layer is not light

    healthy = sorted((n for n, r in results.items() if r.healthy), key=natural_key)
    pairs = [(healthy[i], healthy[i + 1]) for i in range(0, len(healthy) - 1, 2)]
    if not pairs:
        return []
    pair_dir = work / "pairs"
    pair_dir.mkdir(parents=True, exist_ok=True)
    minutes = max(1, int((opts.timeout_s + 59) // 60))
    base = scripts.clusterops_argv()
    script = pair_dir / "pair.sh"
    dist = base + ["health", "dist", "--timeout-s", str(max(10, int(opts.timeout_s * 0.8))),
                   "--size", "16M", "--warmup", "2", "--iters", "5"]
    step = srun_argv(dist, ntasks_per_node=1, kill_on_bad_exit=True)
    script.write_text(scripts.pair_script(pair_dir, step, ib_step=ib_step_argv(opts, base)))
    jobs: Dict[int, Tuple[str, str]] = {}
    for a, b in pairs:
        try:
            jid = slurm.submit(script, args=[f"--nodelist={a},{b}", "--nodes=2", "--ntasks-per-node=1",
                                             "--exclusive", f"--time={minutes}", "--no-requeue",
                                             "--job-name=clusterops-sweep-pair",
                                             f"--output={pair_dir}/%j.slurm.out"]
                             + ([f"--partition={opts.partition}"] if opts.partition else []))
            jobs[jid] = (a, b)
        except ClusteropsError as e:
            errors.append(f"pair {a},{b}: submit failed: {e}")
    deadline = clock() + opts.timeout_s
    out: List[dict] = []
    while jobs and clock() < deadline:
        for jid in [j for j in jobs if (pair_dir / f"{j}.done").exists()]:
            a, b = jobs.pop(jid)
            rc_text = (pair_dir / f"{jid}.done").read_text().strip()
            try:
                doc = json.loads((pair_dir / f"{jid}.json").read_text())
            except (OSError, ValueError):
                doc = None
            status = "pass" if rc_text == "0" else "fail"
            busbw, detail = None, ""
            if isinstance(doc, Mapping):
                busbw = doc.get("busbw_gbps")
                detail = one_line(doc.get("detail") or "")
            elif status != "pass":
                try:
                    detail = one_line((pair_dir / f"{jid}.err").read_text(errors="replace")[-300:])
                except OSError:
                    detail = f"exit {rc_text}, no report"
            ib_dir = pair_dir / f"{jid}.ib"
            # No folder and no step log: the job ran no ibbw step (nothing to report).
            ib = ibbw.read_pair(ib_dir) if ib_dir.exists() or Path(f"{ib_dir}.err").exists() else None
            if ib and ib["status"] == "error":
                errors.append(one_line(f"pair {a},{b}: ib_write_bw: {ib['detail']}"))
            if ib and ib["status"] == "fail" and status == "pass":
                status, detail = "fail", one_line(f"ib_write_bw: {ib['detail']}")
            out.append({"nodes": [a, b], "status": status, "busbw_gbps": busbw, "job_id": jid,
                        "detail": detail, "ib_write_bw": ib})
        sleep(0.3)
    for jid, (a, b) in jobs.items():
        try:
            slurm.cancel(jid)
        except ClusteropsError:
            pass
        out.append({"nodes": [a, b], "status": "unreachable", "busbw_gbps": None, "job_id": jid,
                    "detail": f"no result within {opts.timeout_s:g}s", "ib_write_bw": None})
    return out


def ib_step_argv(opts: SweepOptions, base: List[str]) -> List[str]:
    """The pair's ``ib_write_bw`` step: one task per node, the second killed soon after the
    first exits (a side that skipped does not leave its peer waiting out its deadline). The
    settings are the sweep profile's ``probes.ibbw`` (the nodes resolve the profile as their
    check does); a profile that disables ``ibbw`` runs no step (empty argv)."""
    from clusterops.slurm.steps import srun_argv

    cmd = base + ["health", "ibbw"]
    if not opts.check_cmd:   # a wrapped check's profile is the site's business: the defaults
        from clusterops.health import load_profile

        if "ibbw" not in load_profile(opts.profile).probes:
            return []
        cmd += ["--profile", opts.profile]
    return srun_argv(cmd, ntasks_per_node=1, wait_s=15)
