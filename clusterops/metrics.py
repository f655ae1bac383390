"""Every Prometheus metric clusterops exports, defined once and written through
``prometheus-client`` (its registry, exposition writer and ``write_to_textfile``).

:data:`CATALOGUE` names each metric family with its help text and label names; the
health check (:func:`clusterops.health.prometheus_text`), the sweep
(:func:`clusterops.report.prometheus_text`) and the supervised job's timeline
(:func:`clusterops.supervisor.timeline.prometheus_text`) fill a :class:`Metrics` from their JSON
documents and nothing else writes exposition text. The dashboard and alert rules in
``deploy/`` use only these names (a test holds them to it).

``prometheus_client`` is imported only when metrics are rendered: ``import clusterops``
and the CLI's start stay light.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

# name -> (help, label names). All gauges: each file is a snapshot of its last run.
CATALOGUE: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    # health check (one node)
    "clusterops_health_status": ("Node health: 0 pass, 1 warn, 2 fail, 3 error.", ("node", "profile")),
    "clusterops_health_check_duration_seconds": ("Wall time of the check.", ("node", "profile")),
    "clusterops_health_last_run_timestamp_seconds": ("When the check ran.", ("node", "profile")),
    "clusterops_health_exit_code": ("Exit code of the check: 0 healthy, 1 unhealthy, 3 the fleet guard refused "
                                    "the self-drain, 4 a probe could not check.", ("node", "profile")),
    "clusterops_health_probe_status": ("Probe status: -1 skip, 0 pass, 1 warn, 2 fail, 3 error.", ("node", "probe")),
    "clusterops_health_probe_value": ("The probe's measured value (see unit).", ("node", "probe", "unit")),
    # sweep (the fleet)
    "clusterops_sweep_node_healthy": ("1 when the node passed its check in the last sweep (warnings allowed), 0 when "
                                      "it failed or did not answer; absent when skipped.", ("node",)),
    "clusterops_sweep_node_status": ("The node's status in the last sweep (one series per status, value 1 for the "
                                     "current one).", ("node", "status")),
    "clusterops_sweep_node_straggler": ("1 when a fleet figure of the node is below (1 - tolerance) x the sweep "
                                        "median (above (1 + tolerance) x for fabric error and flap counts).",
                                        ("node",)),
    "clusterops_sweep_node_check_duration_seconds": ("Wall time of the node's health check.", ("node",)),
    "clusterops_sweep_node_matmul_tflops": ("Matmul throughput measured on the node (TFLOPS).", ("node",)),
    "clusterops_sweep_node_busbw_gbps": ("All-reduce bus bandwidth measured on the node (GB/s).", ("node",)),
    "clusterops_sweep_node_copy_bandwidth_gbps": ("Copy bandwidth measured on the node, slowest GPU or pair "
                                                  "(GB/s; kind h2d, d2h, p2p, hbm).", ("node", "kind")),
    "clusterops_sweep_node_fabric_errors": ("InfiniBand/RoCE error counter rises on the node in the fabric "
                                            "probe's window.", ("node",)),
    "clusterops_sweep_node_fabric_flaps": ("Link flaps (link_downed rises) on the node in the fabric probe's "
                                           "window.", ("node",)),
    "clusterops_sweep_node_version_outlier": ("1 when the node's driver/VBIOS versions differ from most of its "
                                              "partition's.", ("node",)),
    "clusterops_sweep_pair_ib_write_bw_gbps": ("ib_write_bw average bandwidth between the node and its pair peer in "
                                               "the last sweep, per rail (Gb/s).", ("node", "peer", "rail")),
    "clusterops_sweep_pair_ib_write_bw_status": ("The pair's ib_write_bw verdict (its worst rail), for each node of "
                                                 "the pair: -1 skip, 0 pass, 1 warn, 2 fail, 3 error.",
                                                 ("node", "peer")),
    "clusterops_sweep_node_action": ("What the sweep did to the node (drain, resume, keep).", ("node", "action")),
    "clusterops_sweep_node_drained": ("1 for a node that carries a drain after the sweep, labelled with who "
                                      "drained it (origin from the clusterops:<origin>: reason; other: not "
                                      "clusterops).", ("node", "origin")),
    "clusterops_sweep_drained_nodes": ("Nodes that carry a drain after the sweep, by origin.", ("origin",)),
    "clusterops_sweep_fleet_median": ("The sweep's fleet median of a per-node figure.", ("metric",)),
    "clusterops_sweep_nodes": ("Nodes per status in the last sweep.", ("status",)),
    "clusterops_sweep_stragglers": ("Stragglers in the last sweep.", ()),
    "clusterops_sweep_guard_tripped": ("1 when the drain safety guard refused to drain.", ()),
    "clusterops_sweep_drains_refused": ("Drains the safety guard refused in the last sweep.", ()),
    "clusterops_sweep_timestamp_seconds": ("When the last sweep finished (epoch seconds).", ()),
    "clusterops_sweep_duration_seconds": ("Wall time of the last sweep.", ()),
    "clusterops_sweep_exit_code": ("Exit code of the last sweep.", ()),
    # the cron pass over supervised jobs (clusterops job watch without a job id: jobwatch.py)
    "clusterops_watch_job_flagged": ("1 for each flag the last pass raised on a job (restart_storm, stalled, "
                                     "chain_dry).", ("job", "user", "flag")),
    "clusterops_watch_flagged_jobs": ("Jobs flagged by the last pass.", ()),
    "clusterops_watch_timestamp_seconds": ("When the last pass ran (epoch seconds).", ()),
    # supervised job (its timeline)
    "clusterops_job_restarts": ("In-allocation restarts of the supervised job, all incarnations.", ("job",)),
    "clusterops_job_requeues": ("Times the supervised job was requeued.", ("job",)),
    "clusterops_job_launches": ("Launches of the training step.", ("job",)),
    "clusterops_job_faults": ("Faults seen (lost heartbeats, lost nodes, failed steps).", ("job",)),
    "clusterops_job_given_up": ("1 when the supervisor gave the job up.", ("job",)),
    "clusterops_job_finished": ("1 when the job finished its training.", ("job",)),
    "clusterops_job_exit_code": ("The supervisor's exit code (absent while running).", ("job",)),
    "clusterops_job_last_step": ("The last training step reported.", ("job",)),
    "clusterops_job_goodput_ratio": ("Productive share of the job's wall time (recomputed steps and checkpoint "
                                     "stalls excluded).", ("job",)),
    "clusterops_job_wall_seconds": ("Wall time from the first launch to the last timeline record.", ("job",)),
    "clusterops_job_productive_seconds": ("Wall time in which the step advanced past every step reached before.",
                                          ("job",)),
    "clusterops_job_lost_seconds": ("Wall time lost, by cause (startup, restart, inprocess, requeue_wait, recomputed, "
                                    "checkpoint_stall, stalled, other).", ("job", "cause")),
    "clusterops_job_mttr_seconds": ("Mean time from a fault to the first step after it (absent before a "
                                    "recovery).", ("job",)),
    "clusterops_job_last_event_timestamp_seconds": ("When the job's timeline last changed.", ("job",)),
    "clusterops_job_anomalies": ("Loss spikes and non-finite values the stability guard found, by kind "
                                 "(loss_spike, nan).", ("job", "kind")),
    "clusterops_job_rollbacks": ("Rollbacks of the stability guard (to an earlier checkpoint, data skipped).",
                                 ("job",)),
    "clusterops_job_stragglers": ("Stragglers the supervisor found in the job (nodes whose ranks' busy time per "
                                  "step stayed above straggler_ratio x the other nodes' median).", ("job",)),
    "clusterops_job_stragglers_replaced": ("Stragglers replaced by a spare node at a planned checkpoint stop.",
                                           ("job",)),
    "clusterops_job_inprocess_recoveries": ("Faults healed in-process (supervise: inprocess:): a standby took "
                                            "the lost rank, no relaunch.", ("job",)),
    "clusterops_job_inprocess_fallbacks": ("In-process recoveries given up for the full relaunch.", ("job",)),
    "clusterops_job_inprocess_recovery_seconds": ("The latest in-process recovery: the fault heard -> the new "
                                                  "generation's first step.", ("job",)),
    "clusterops_job_node_slowness_ratio": ("A node's busy time per step over the median of the other nodes': for "
                                           "each straggler when found, and for the slowest node at the latest "
                                           "progress sample.", ("job", "node")),
}


def metric_names() -> set:
    return set(CATALOGUE)


class Metrics:
    """One exposition: a private registry whose gauges are made on first use.
    Setting one series twice keeps the last value (a scrape holds each series once)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self._gauges: Dict[str, object] = {}

    def set(self, name: str, labels: Mapping[str, object], value: object) -> None:
        from prometheus_client import Gauge

        help_text, labelnames = CATALOGUE[name]
        g = self._gauges.get(name)
        if g is None:
            g = self._gauges[name] = Gauge(name, help_text, labelnames, registry=self.registry)
        if set(labels) != set(labelnames):
            raise ValueError(f"{name}: labels {sorted(labels)} != {sorted(labelnames)}")
        target = g.labels(**{k: str(labels[k]) for k in labelnames}) if labelnames else g
        target.set(_float(value))  # type: ignore[attr-defined]

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def write_textfile(self, path: "os.PathLike | str") -> None:
        """Atomically (prometheus-client writes a sibling and renames it), refusing a
        target that is not a regular file, as every output of clusterops does."""
        from prometheus_client import write_to_textfile

        from clusterops.errors import ClusteropsError
        from clusterops.fsutil import check_output_target

        p = Path(path)
        check_output_target(p)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(str(p), self.registry)
        except OSError as e:
            raise ClusteropsError(f"{p}: cannot write: {e.strerror or e}") from None


def _float(v: object) -> float:
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def drain_origin(reason: Optional[str]) -> str:
    """Who drained a node, from its Slurm reason: ``clusterops:<origin>: ...`` gives the
    origin; an older plain ``clusterops: ...`` reason is ``legacy``; anything else (an
    administrator, Slurm itself) is ``other``."""
    from clusterops.drains import parse_reason   # the one reader of clusterops' reasons

    parsed = parse_reason((reason or "").strip())
    return parsed.origin if parsed is not None else "other"
