"""Declarative schemas for the inputs: one field table per input.

A :class:`Field` says a key's name, type, bounds or choices, default and meaning. The
tables here:

- health profiles and the health site config (``PROFILE``, ``SITE``, ``PROBE_SETTINGS``):
  ``validate()`` checks them (every level, list items, types, ranges, choices, unknown keys
  with a suggestion);
- the job spec of ``clusterops launch`` (``JOB_SPEC``) with its ``supervise:`` section
  (``SUPERVISE``, the one table of the supervise keys) and the supervisor's own settings
  (``POLICY_ONLY``). ``clusterops.launch.spec`` validates a spec by them; the supervisor's
  ``Policy`` is made from them (``dataclass_of``, ``problems``); the flags of
  ``clusterops supervise`` are generated from them.

Values are walked by one interpreter, ``Checker.check(value, field, path)``, dispatching on
the field's kind through a registry: ``KINDS`` (profiles, site config), ``POLICY_KINDS``
(``problems``), and the job spec's ``clusterops.launch.spec.SPEC_KINDS``, which extends
``KINDS`` with its own kinds (path, hostlist, time, mem, lines). docs/foundation.md says why
this is not pydantic or msgspec.

The key tables in docs/health.md, docs/launch.md and docs/supervisor.md are generated too
(between ``<!-- schema:NAME -->`` marks): ``python -m clusterops.schema`` prints the health
tables, ``--check ROOT`` compares every generated table with the docs, ``--write ROOT``
rewrites them; a test keeps the docs in step.

The probe settings below are what each probe's code reads (``clusterops/health/probes/*``):
when a probe learns a setting, its row is added here, or profiles using it are refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops import yamlio
from clusterops.errors import InputError
from clusterops.protocol import ENV_CKPT_DIR

Path_ = Tuple[Any, ...]
DAY_S = 86400.0


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # bool int number str enum version regex list map dict union probe any
    doc: str = ""
    default: Any = None
    nullable: bool = False
    min: Optional[float] = None
    max: Optional[float] = None
    gt: bool = False                     # min is exclusive
    choices: Tuple[Any, ...] = ()
    item: Optional["Field"] = None       # list items / dict values
    fields: Tuple["Field", ...] = ()     # map keys
    options: Tuple["Field", ...] = ()    # union alternatives
    required: bool = False               # the key must be present in its map
    min_len: int = 0
    max_len: Optional[int] = None
    default_text: str = ""               # docs: a default that is worked out, not a value
    flags: Tuple[str, ...] = ()          # extra command-line names (`clusterops supervise`)
    policy: bool = False                 # a field of the supervisor's Policy

    def type_text(self) -> str:
        if self.kind == "enum":
            t = " | ".join(str(c) for c in self.choices)
        elif self.kind == "list":
            t = f"list of {self.item.type_text() if self.item else 'any'}"
            if self.min_len and self.min_len == self.max_len:
                t = f"list of {self.min_len} {self.item.type_text() if self.item else 'any'}"
        elif self.kind == "union":
            t = " or ".join(o.type_text() for o in self.options)
        elif self.kind in ("map", "probe"):
            t = "mapping"
        elif self.kind == "dict":
            t = "mapping name -> " + (self.item.type_text() if self.item else "any")
        elif self.kind == "version":
            t = "version"
        elif self.kind == "regex":
            t = "regular expression"
        elif self.kind in _KIND_NAMES:
            t = _KIND_NAMES[self.kind]
        else:
            t = self.kind
        rng = self.range_text()
        if rng:
            t += f" {rng}"
        if self.nullable:
            t += " or null"
        return t

    def range_text(self) -> str:
        if self.kind not in ("int", "number"):
            return ""
        lo, hi = self.min, self.max
        if lo is not None and hi is not None:
            return f"{'(' if self.gt else '['}{lo:g}, {hi:g}]"
        if lo is not None:
            return f"{'>' if self.gt else '>='} {lo:g}"
        if hi is not None:
            return f"<= {hi:g}"
        return ""


# Kinds of the job spec, as the docs name them. "text" may span lines, "str" may not.
_KIND_NAMES = {"url": "http(s) URL", "text": "text", "path": "path", "hostlist": "hostlist", "time": "Slurm time",
               "mem": "size", "lines": "lines", "profile": "profile or false",
               "exitcodes": "mapping exit code -> action", "trackers": "list of tracker mappings"}
# Kinds whose YAML scalars are taken as written (no 1.1 booleans, octal, floats).
TEXT_KINDS = frozenset({"str", "url", "text", "path", "hostlist", "time", "mem", "lines"})


#: What a training script's exit code may ask of the supervisor (``supervise: exit_codes:``).
EXIT_ACTIONS = ("relaunch", "relaunch_without_suspects", "requeue", "stop")
#: Exit codes whose meaning is published by the frameworks that use them (docs/supervisor.md).
DEFAULT_EXIT_CODES = {16: "relaunch_without_suspects", 17: "stop", 93: "stop"}


def _f(name, kind, doc="", **kw) -> Field:
    return Field(name, kind, doc, **kw)


def seconds(name: str, doc: str, default: Any = None, **kw) -> Field:
    # 0.1 s at least: a shorter deadline only turns a healthy probe into a "hung" one.
    return Field(name, "number", doc, default=default, min=0.1, max=DAY_S, **kw)


def count(name: str, doc: str, default: Any = None, hi: float = 1e9, **kw) -> Field:
    return Field(name, "int", doc, default=default, min=0, max=hi, **kw)


# -- probe settings: read from each probe's code ---------------------------------------------

COMMON_SETTINGS: Tuple[Field, ...] = (
    seconds("timeout_s", "the probe's deadline; past it the probe is an `error`", 10),
    _f("enabled", "bool", "false disables the probe (as `probe: false` does)", default=True),
)

_SHAPE = Field("shape", "list", item=Field("dim", "int", min=1, max=1 << 17), min_len=3, max_len=3)

PROBE_SETTINGS: Dict[str, Tuple[Field, ...]] = {
    "nvml": (
        _f("required", "bool", "no GPU / no NVML is a failure (default: the profile's `gpus.required`)"),
        _f("slowdown_fail_fraction", "number", "HW thermal/power-brake slowdown time between two checks, as a "
           "share of the time between them, above which the GPU fails (any slowdown warns)", default=0.05,
           min=0, max=1),
        _f("state_file", "str", "default $CLUSTEROPS_STATE_DIR or /var/lib/clusterops/nvml-<node>.json",
           nullable=True),
        count("gpu_count", "GPUs expected (default: `gpus.count`, else Slurm's gres for the node)",
              hi=1024, nullable=True),
        _f("temperature_warn_c", "number", "warn at or above", default=85, min=0, max=200),
        _f("temperature_fail_c", "number", "fail at or above", default=95, min=0, max=200),
        count("ecc_volatile_max", "uncorrectable ECC since driver load; fail above", 0),
        count("ecc_aggregate_max", "lifetime uncorrectable ECC; warn above", 0),
        count("sram_uncorrected_max", "uncorrectable SRAM errors; fail above", 0),
        count("nvlink_recovery_max", "NVLink recovery errors; fail above", 0),
        count("nvlink_crc_replay_max", "NVLink CRC + replay errors; warn above", 1000),
        count("nvlink_links", "NVLink links per GPU (default: the GPU model's)", hi=64, nullable=True),
        _f("pcie_gen_busy_pct", "number", "judge the PCIe generation only at this utilisation", default=50,
           min=0, max=100),
        _f("persistence_required", "bool", "persistence mode off fails (else warns)", default=False),
        _f("leftover_process_status", "enum", "status of a GPU process that belongs to no Slurm job",
           default="fail", choices=("fail", "warn")),
        _f("gpus_from_slurm", "bool", "with no gpu_count, a node that shows GPUs is held to its Slurm gres",
           default=True),
        seconds("slurm_timeout_s", "deadline of that one Slurm query", 2),
        _f("driver", "map", "driver version rule", fields=(
            _f("min", "version", "oldest driver allowed, e.g. \"535.104\"", nullable=True),
            _f("exact", "version", "the fleet's one driver, e.g. \"550.54.15\"", nullable=True),
        )),
    ),
    "amd": (
        _f("required", "bool", "no AMD GPU / no amdsmi is a failure (default: `gpus.required`)"),
        count("gpu_count", "AMD GPUs expected (default: `gpus.count`, else an AMD-typed Slurm gres)", hi=1024,
              nullable=True),
        count("ecc_uncorrectable_max", "uncorrectable ECC errors; fail above", 0),
        count("ecc_deferred_max", "deferred ECC errors; fail above", 0),
        count("ecc_correctable_max", "correctable ECC errors; warn above", 1000),
        count("bad_pages_max", "retired (reserved) pages; warn above", 64, hi=1e6),
        count("xgmi_links", "XGMI links that must be up per GPU (7 in an 8-GPU MI300X hive)", hi=64,
              nullable=True),
        _f("pcie_busy_pct", "number", "judge the PCIe speed only at this activity", default=50, min=0, max=100),
        _f("temperature_warn_c", "number", "hotspot or HBM temperature that warns", default=95, min=0, max=200),
        _f("temperature_fail_c", "number", "hotspot or HBM temperature that fails", default=105, min=0, max=200),
        _f("gres_from_slurm", "bool", "on a GPU partition, ask Slurm's gres whether the node has AMD GPUs",
           default=True),
        seconds("slurm_timeout_s", "deadline of that one Slurm query", 2),
        _f("cli", "bool", "without the amdsmi library, read the `amd-smi` CLI's JSON on a node with AMD GPUs",
           default=True),
        _f("amd_smi", "str", "the amd-smi program", default="amd-smi"),
        seconds("cli_timeout_s", "deadline of each of the four amd-smi calls", 10),
    ),
    "xid": (
        _f("source", "enum", "where the kernel log comes from", default="auto",
           choices=("auto", "dmesg", "journal", "file")),
        _f("log_file", "str", "kernel log file (source: file)", nullable=True),
        _f("state_file", "str", "default $CLUSTEROPS_STATE_DIR or /var/lib/clusterops/xid-<node>.json",
           nullable=True),
        _f("boot_id_file", "str", "", default="/proc/sys/kernel/random/boot_id"),
        seconds("read_timeout_s", "deadline of dmesg / journalctl", 5),
    ),
    "host.paths": (
        seconds("path_timeout_s", "deadline of each path's statvfs + write", 5),
        _f("paths", "list", "paths that must exist with room to spare", default=[], item=_f("path", "map", fields=(
            _f("path", "str", "`${VAR}` expanded; an unset variable fails", required=True),
            _f("min_free_gb", "number", "", default=0, min=0, max=1e9),
            count("min_free_inodes", "", 0, hi=1e15),
            _f("writable", "bool", "write + fsync a small file", default=True),
        ))),
    ),
    "host.mounts": (
        seconds("path_timeout_s", "deadline of each mount's write test", 5),
        _f("mounts", "list", "mount points (a path, or a mapping)", default=[], item=_f("mount", "union", options=(
            _f("path", "str"),
            _f("mount", "map", fields=(
                _f("path", "str", "", required=True),
                _f("fstype", "str", "expected filesystem type, e.g. nfs4", nullable=True),
                _f("writable", "bool", "", default=True),
            )),
        ))),
        _f("mounts_file", "str", "", default="/proc/self/mounts"),
    ),
    "host.memory": (
        _f("min_available_gb", "number", "MemAvailable below this fails", default=0, min=0, max=1e9),
        _f("meminfo_file", "str", "", default="/proc/meminfo"),
    ),
    "host.cpus": (
        count("min_cpus", "online CPUs below this fail (null: not checked)", hi=1 << 20, nullable=True),
    ),
    "host.infiniband": (
        _f("sys_root", "str", "", default="/sys/class/infiniband"),
        _f("required", "bool", "no HCA fails (else skips)", default=False),
        _f("expected_rate_gbps", "number", "slowest port rate allowed", min=0, gt=True, max=1e6, nullable=True),
        count("min_ports", "ACTIVE ports needed", 0, hi=1024, nullable=True),
        _f("infiniband_only", "bool", "hold only InfiniBand-link ports to the rules", default=True),
    ),
    "fabric": (
        _f("sys_root", "str", "", default="/sys/class/infiniband"),
        _f("devices", "list", "HCA names whose ports are judged (shell patterns, e.g. mlx5_*); other HCAs' "
           "ports are only reported; empty: all", default=[], item=Field("device", "str"), max_len=256),
        _f("link_layers", "list", "link layers judged: InfiniBand, Ethernet (RoCE: only ports that `ports` or "
           "`devices` name)", default=["InfiniBand", "Ethernet"],
           item=Field("layer", "enum", choices=("InfiniBand", "Ethernet")), min_len=1, max_len=2),
        _f("ports", "list", "the ports this node must have up, judged (shell patterns on DEV/PORT or on a "
           "device, e.g. mlx5_[0-7]/1; one that matches no port fails); empty: those of `devices`, else the "
           "InfiniBand ports. Other ports are only reported", default=[], item=Field("port", "str"),
           max_len=256),
        _f("required", "bool", "no port fails (else skips)", default=False),
        _f("expected_rate_gbps", "number", "slowest port rate allowed", min=0, gt=True, max=1e6, nullable=True),
        _f("expected_width", "enum", "narrowest link width allowed (null: a port narrower than its "
           "siblings warns)", choices=("1X", "2X", "4X", "8X", "12X"), nullable=True),
        count("min_ports", "ACTIVE ports needed", 0, hi=1024, nullable=True),
        _f("state_file", "str", "default $CLUSTEROPS_STATE_DIR or /var/lib/clusterops/fabric-<node>.json",
           nullable=True),
        _f("window_h", "number", "hours over which counter rises and flaps are summed", default=24, min=0,
           gt=True, max=24 * 365),
        count("flaps_warn", "link_downed rises in the window that warn", 1, hi=1e6, nullable=True),
        count("flaps_fail", "link_downed rises in the window that fail", 5, hi=1e6, nullable=True),
        _f("counters", "map", "error counter -> {warn, fail}: rises in the window", fields=tuple(
            _f(name, "map", "", fields=(count("warn", "", hi=1e12, nullable=True),
                                        count("fail", "", hi=1e12, nullable=True)))
            for name in ("symbol_error", "link_error_recovery", "port_rcv_errors",
                         "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors", "port_xmit_discards",
                         "port_xmit_constraint_errors", "port_rcv_constraint_errors",
                         "local_link_integrity_errors", "excessive_buffer_overrun_errors", "VL15_dropped"))),
    ),
    # Not run by `health check`: the sweep's pair mode (`sweep --pairs`) runs it between two
    # nodes (`clusterops health ibbw --profile P`), with these settings of the sweep's profile.
    "ibbw": (
        _f("sys_root", "str", "", default="/sys/class/infiniband"),
        _f("devices", "list", "HCA names whose ports are tested (shell patterns, e.g. mlx5_*); empty: all",
           default=[], item=Field("device", "str"), max_len=256),
        _f("link_layers", "list", "link layers tested: InfiniBand, Ethernet (RoCE)",
           default=["InfiniBand", "Ethernet"], item=Field("layer", "enum", choices=("InfiniBand", "Ethernet")),
           min_len=1, max_len=2),
        _f("all_rails", "bool", "every ACTIVE port, one result per rail (false: the first ACTIVE port only)",
           default=True),
        _f("gpudirect", "bool", "GPU memory buffers (`--use_cuda`) where the node has an NVIDIA GPU",
           default=False),
        _f("gpu", "int", "the GPU of the GPUDirect buffers", default=0, min=0, max=63),
        _f("gid_index", "int", "RoCE GID index passed as `-x` (null: chosen from sysfs, RoCE v2 with an "
           "IPv4-mapped address first); InfiniBand ports never take one", min=0, max=1023, nullable=True),
        _f("tcp_port", "int", "perftest's out-of-band port of the first rail (rail i uses tcp_port + i)",
           default=18515, min=1024, max=65000),
        _f("size_bytes", "int", "message size", default=1 << 20, min=1, max=1 << 30),
        _f("iters", "int", "iterations per rail", default=2000, min=1, max=10_000_000),
        _f("floors", "map", "per-rate floors of the average bandwidth in Gb/s, by the port's rate name: "
           "{fail, warn}; over the built-in ones", fields=tuple(
               _f(rate, "map", "", fields=(_f("fail", "number", "", min=0, max=1e6, nullable=True),
                                           _f("warn", "number", "", min=0, max=1e6, nullable=True)))
               for rate in ("SDR", "DDR", "QDR", "FDR10", "FDR", "EDR", "HDR", "NDR", "XDR"))),
        _f("fail_fraction", "number", "a rate with no floor fails below this share of its line rate",
           default=0.9, min=0, max=1),
        _f("warn_fraction", "number", "and warns below this share", default=0.95, min=0, max=1),
    ),
    "host.stray_processes": (
        _f("status", "enum", "status when processes of finished jobs are found", default="warn",
           choices=("warn", "fail")),
        seconds("slurm_timeout_s", "deadline of the Slurm query", 3),
    ),
    "dcgm": (
        _f("level", "int", "dcgmi diag -r LEVEL", default=1, min=1, max=4),
        _f("required", "bool", "no dcgmi fails (else skips)", default=False),
        _f("dcgmi", "str", "the dcgmi program", default="dcgmi"),
        seconds("diag_timeout_s", "deadline of the diag", 900),
        _f("output_file", "str", "read a recorded `dcgmi diag -j` output instead", nullable=True),
        _f("exit_code", "int", "exit code that goes with output_file", default=0, min=0, max=255),
        seconds("hostengine_timeout_s", "deadline of the nv-hostengine liveness query and of each "
                "`dcgmi health` call; past it: error, never a drain", 10),
        _f("health", "bool", "also check DCGM's health watches (`dcgmi health -c`)", default=False),
        _f("health_group", "int", "the DCGM group whose watches are checked", default=0, min=0, max=1 << 31),
        _f("health_output_file", "str", "read a recorded `dcgmi health -c -j` output instead", nullable=True),
    ),
    "matmul": (
        _f("required", "bool", "no CUDA device fails (default: `gpus.required`)"),
        count("warmup", "", 3, hi=1e6),
        _f("iters", "int", "", default=10, min=1, max=1e6),
        _f("gpu_shapes", "list", "[m, n, k] per shape", item=_SHAPE, min_len=1, max_len=64),
        _f("cpu_shapes", "list", "[m, n, k] per shape", item=_SHAPE, min_len=1, max_len=64),
        _f("min_fraction", "number", "best TFLOPS / the model's expected figure", default=0.85, min=0, max=1),
        _f("straggler_pct", "number", "slower than the node's best GPU by more fails", default=10, min=0, max=100),
        _f("cpu_expected_tflops", "number", "expected fp32 TFLOPS on a CPU node", min=0, gt=True, max=1e6,
           nullable=True),
        _f("flush_l2", "bool", "flush L2 between iterations", default=True),
    ),
    "copybw": (
        _f("required", "bool", "no CUDA device is an error (default: `gpus.required`)"),
        _f("kinds", "list", "what to measure", default=["h2d", "d2h", "p2p", "hbm"],
           item=Field("kind", "enum", choices=("h2d", "d2h", "p2p", "hbm")), min_len=1, max_len=4),
        _f("size_mib", "int", "MiB per copy", default=256, min=1, max=16384),
        count("warmup", "", 3, hi=1e6),
        _f("iters", "int", "", default=10, min=1, max=1e6),
        _f("min_h2d_gbps", "number", "floor over the model's h2d_gbps", min=0, gt=True, max=1e6, nullable=True),
        _f("min_d2h_gbps", "number", "floor over the model's d2h_gbps", min=0, gt=True, max=1e6, nullable=True),
        _f("min_p2p_gbps", "number", "floor over the model's p2p_gbps", min=0, gt=True, max=1e6, nullable=True),
        _f("min_hbm_gbps", "number", "floor over hbm_min_fraction x the model's hbm_gbps", min=0, gt=True,
           max=1e6, nullable=True),
        _f("hbm_min_fraction", "number", "share of the model's peak memory bandwidth a GPU must reach",
           default=0.7, min=0, max=1),
        _f("straggler_pct", "number", "slower than the node's best GPU (pair) by more fails", default=15,
           min=0, max=100),
    ),
    "sdc": (
        _f("required", "bool", "no CUDA device fails (default: `gpus.required`)"),
        _f("size", "int", "square matrix side of the GEMM chain", default=256, min=16, max=16384),
        _f("iterations", "int", "GEMMs in the chain", default=8, min=1, max=10000),
        _f("seed", "int", "the workload's random seed", default=29, min=0, max=2**31 - 1),
        _f("gpu_dtype", "enum", "GEMM type on GPUs (CPU: float32)", default="bfloat16",
           choices=("bfloat16", "float32")),
        _f("expected", "dict", "model key -> recorded hex digest for this workload (over the digests file)",
           default={}, item=Field("digest", "str")),
        _f("digests_file", "str", "recorded digests (default: the built-in health/sdc_digests.yaml)",
           nullable=True),
    ),
    "dist": (
        seconds("test_timeout_s", "each rank's deadline (default 0.7 x timeout_s)"),
        _f("cpu_ranks", "int", "gloo ranks on a CPU-only node", default=2, min=1, max=1024),
        count("local_ranks", "ranks to start (default: one per GPU)", hi=1024, nullable=True),
        _f("backend", "enum", "", default="auto", choices=("auto", "nccl", "gloo")),
        _f("sizes_bytes", "list", "all-reduce payloads on GPUs", default=[],
           item=Field("size", "int", min=1, max=1 << 36), max_len=64),
        _f("cpu_sizes_bytes", "list", "all-reduce payloads on CPU nodes",
           item=Field("size", "int", min=1, max=1 << 36), max_len=64),
        count("warmup", "", 5, hi=1e6),
        _f("iters", "int", "", default=20, min=1, max=1e6),
        _f("min_busbw_gbps", "number", "busbw below fails", min=0, gt=True, max=1e6, nullable=True),
    ),
}


def probe_field(name: str) -> Field:
    return Field(name, "probe", fields=PROBE_SETTINGS[name] + COMMON_SETTINGS)


PROBES = Field("probes", "map", "probe name -> settings, or false to disable it",
               fields=tuple(probe_field(n) for n in PROBE_SETTINGS))
GPUS = Field("gpus", "map", "what the node must have", fields=(
    _f("required", "bool", "no GPU is a failure (else a skip on a node that shows no GPUs)", default=False),
    count("count", "GPUs per node (null: Slurm's gres for the node, else what NVML sees)", hi=1024,
          nullable=True),
))
PROFILE = Field("profile", "map", fields=(
    _f("description", "str", "one line for `health profiles`"),
    _f("extends", "str", "parent profile (built-in name or file)"),
    GPUS,
    PROBES,
))
GPU_MODEL = Field("gpu_model", "map", fields=(
    _f("match", "list", "regular expressions against the NVML device name (default: the model's key)",
       item=_f("pattern", "regex"), min_len=1),
    _f("matmul_bf16_tflops", "number", "expected best bf16 matmul TFLOPS", min=0, gt=True, max=1e6,
       nullable=True),
    count("nvlink_links", "NVLink links per GPU", hi=64, nullable=True),
    count("max_sm_clock_mhz", "the model's maximum SM clock; a GPU whose maximum is lower fails", hi=1e5,
          nullable=True),
    _f("h2d_gbps", "number", "host-to-device pinned copy floor per GPU (GB/s)", min=0, gt=True, max=1e6,
       nullable=True),
    _f("d2h_gbps", "number", "device-to-host pinned copy floor per GPU (GB/s)", min=0, gt=True, max=1e6,
       nullable=True),
    _f("p2p_gbps", "number", "peer-to-peer copy floor per GPU pair (GB/s)", min=0, gt=True, max=1e6,
       nullable=True),
    _f("hbm_gbps", "number", "device-memory bandwidth, the vendor's peak (GB/s)", min=0, gt=True, max=1e6,
       nullable=True),
    _f("allreduce_busbw_gbps", "number", "all-reduce busbw floor over the node's GPUs (GB/s)", min=0, gt=True,
       max=1e6, nullable=True),
))
DRAIN = Field("drain", "map", "the fleet guard of --drain-on-fail", fields=(
    _f("max_drained_fraction", "number", "share of a partition's nodes that may carry a clusterops drain "
       "at once (env CLUSTEROPS_MAX_DRAINED_FRACTION)", default=0.1, min=0, max=1),
    _f("partition", "str", "the partition the share is counted in (default: the node's partitions)",
       nullable=True),
))
HISTORY = Field("history", "map", "where health checks record their results (clusterops.spool)", fields=(
    _f("db", "str", "a SQLite path, sqlite:///path or postgresql://... (env CLUSTEROPS_HISTORY_DB)"),
    _f("spool_dir", "str", "local spool for results the database could not take yet"),
    _f("spool_max_files", "int", "spool cap, files", default=2000, min=1, max=10_000_000),
    _f("spool_max_bytes", "int", "spool cap, bytes", default=32 << 20, min=4096, max=1 << 40),
    _f("timeout_s", "number", "the longest a check waits on the database", default=3.0, min=0.5, max=120),
))
QUARANTINE = Field("quarantine", "map", "repeat offenders: a node or GPU blamed `blames` times within "
                   "`window_s` is drained until a person clears it (clusterops.quarantine)", fields=(
    _f("blames", "int", "blames (failed checks, sweeps, supervisor verdicts) that quarantine", default=3,
       min=1, max=1000),
    _f("window_s", "number", "the window the blames are counted in, seconds", default=604800.0, min=60,
       max=366 * 86400),
))
WEBHOOK = Field("webhook", "map", "a webhook: generic JSON or Slack-compatible (clusterops.notify)", fields=(
    _f("url", "url", "http:// or https:// URL", required=True),
    _f("format", "enum", "payload shape", default="json", choices=("json", "slack")),
    _f("events", "list", "events to send (default: all)", item=_f("event", "enum", choices=(
        "node_drained", "node_resumed", "guard_tripped", "sweep_cannot_run", "job_given_up", "job_requeued",
        "job_rolled_back", "job_diverged"))),
    _f("timeout_s", "number", "per attempt", default=5.0, min=0.1, max=60),
    _f("retries", "int", "attempts after the first", default=1, min=0, max=10),
))
NOTIFY = Field("notify", "list", "webhooks told about drains, resumes, guard trips and sweeps that could "
               "not run", item=Field("target", "union", options=(_f("url", "url"), WEBHOOK)))
SLURM = Field("slurm", "map", "how clusterops reaches Slurm (clusterops.slurm.settings); the "
              "CLUSTEROPS_SLURM_* variables win over these", fields=(
    _f("backend", "enum", "auto: slurmrestd when `url` is set, else pyslurm where it matches the controller, "
       "else the CLI tools", default="auto", choices=("auto", "cli", "pyslurm", "rest")),
    _f("url", "str", "slurmrestd: unix:///PATH, http://HOST:PORT or https://HOST:PORT (docs/slurmrestd.md)"),
    _f("jwt_key", "str", "slurmrestd: sign tokens with this HS256 key file (else SLURM_JWT or scontrol token)"),
    _f("ca_file", "str", "slurmrestd over https: the PEM CA bundle its certificate is checked against "
       "(else the system's, or SSL_CERT_FILE)"),
))
SITE = Field("site", "map", fields=(
    Field("gpu_models", "dict", "merged over the built-in gpu_models.yaml", item=GPU_MODEL),
    Field("defaults", "map", "merged into every profile", fields=(GPUS, PROBES)),
    Field("profiles", "dict", "per-profile overrides, by profile name", item=Field("profile", "map", fields=(
        _f("description", "str"), GPUS, PROBES))),
    DRAIN,
    HISTORY,
    QUARANTINE,
    NOTIFY,
    SLURM,
))


# -- the job spec (`clusterops launch`) and its supervise: section ---------------------------
#
# The one table of the supervise keys: the job-spec validation (clusterops.launch.spec), the
# supervisor's Policy (clusterops.supervisor.machine), the flags of `clusterops supervise`
# and the tables in docs/launch.md and docs/supervisor.md all come from it.

MAX_COUNT = 100000
#: The modes a job directory may be created with (supervise.job_dir_mode): the user's alone,
#: or readable (never writable) by the group or everyone, for timelines and metrics.
JOB_DIR_MODES = ("0700", "0750", "0755")


def _policy(name: str, kind: str, doc: str, default: Any = None, **kw) -> Field:
    """A key the supervisor's state machine reads (a field of Policy)."""
    return Field(name, kind, doc, default=default, policy=True, **kw)


def _timeout(name: str, doc: str, default: float) -> Field:
    return _policy(name, "number", doc, default, min=0, gt=True)


def _budget(name: str, doc: str, default: int, lo: int = 0, **kw) -> Field:
    return _policy(name, "int", doc, default, min=lo, max=MAX_COUNT, **kw)


_ACTIONS = ("record", "stop", "rollback", "replay")

#: ``supervise: {stability: {...}}``; ``clusterops.supervisor.stability.StabilityConfig`` is made
#: from these fields (defaults from published practice: docs/supervisor.md).
STABILITY_FIELDS: Tuple[Field, ...] = (
    _f("on_spike", "enum", "what a loss spike does", default="record", choices=_ACTIONS),
    _f("on_nan", "enum", "what a non-finite loss or grad norm does", default="rollback", choices=_ACTIONS),
    _f("window", "int", "in-band samples (about one a second) the band is the median and MAD of", default=128,
       min=4, max=100000),
    _f("factor", "number", "a spike is above median + factor x 1.4826 MAD (about sigmas)", default=6.0,
       min=1, gt=True),
    _f("patience", "int", "samples in a row above the band before it is a spike", default=2, min=1, max=1000),
    _f("min_samples", "int", "samples in the band before spikes are judged", default=8, min=1, max=100000),
    _f("warmup_steps", "int", "steps from the start in which only non-finite values are findings", default=100,
       min=0, max=10**9),
    _f("resume_grace_steps", "int", "steps after each resume in which only non-finite values are findings",
       default=10, min=0, max=10**9),
    _f("watch_grad_norm", "bool", "judge the grad norm too, when the script reports it", default=True),
    _f("rollback_steps", "int", "roll back to the newest checkpoint at least this many steps before the "
       "anomaly began", default=100, min=0, max=10**9),
    _f("skip_batches", "int", "batches the script skips after a rollback (from the data position of the "
       "checkpoint); more when that would not reach skip_batches - rollback_steps past the last step seen "
       "anomalous", default=200, min=0, max=10**9),
    _f("lr_factor", "number", "learning-rate factor the script is told to apply after a rollback", default=1.0,
       min=0, gt=True, max=1000),
    _f("max_rollbacks", "int", "rollbacks within `rollback_window_steps` before giving up (exit 9)", default=3,
       min=0, max=1000),
    _f("rollback_window_steps", "int", "steps within which rollbacks count together", default=10000, min=1,
       max=10**9),
    _f("replay_margin_steps", "int", "`replay`: steps the replay runs past the step the anomaly was seen at "
       "(or past the ranks' first non-finite step, when that is later)",
       default=2, min=0, max=10**6),
)

#: ``supervise: {trackers: [...]}``: one mapping per tracker, its ``kind`` naming which
#: (clusterops.trackers writes them; docs/trackers.md). Each kind has its own keys.
TRACKER_KINDS = ("tensorboard", "wandb", "mlflow")


def _tracker(kind: str, doc: str, *fields: Field) -> Field:
    return Field(kind, "map", doc, fields=(
        Field("kind", "enum", "which tracker", choices=TRACKER_KINDS, required=True),) + fields)


TRACKER_FIELDS: Tuple[Field, ...] = (
    _tracker("tensorboard", "event files written with TensorBoard's own writer",
             _f("dir", "path", "the log directory (relative to `workdir`); every incarnation appends its own "
                "event file there", default_text="`<job_dir>/tensorboard`")),
    _tracker("wandb", "one Weights & Biases run per job, resumed by every incarnation (its id is kept in the "
             "job directory)",
             _f("project", "str", "the W&B project", default_text="the job's name"),
             _f("entity", "str", "the W&B entity (user or team)", default_text="W&B's default"),
             _f("name", "str", "the run's display name", default_text="`<name>-<job id>`"),
             _f("group", "str", "the run's group", default_text="none"),
             _f("mode", "enum", "`offline` writes run files only (no network; `wandb sync` uploads them later); "
                "`online` needs `WANDB_API_KEY` in the job's environment", default="offline",
                choices=("offline", "online")),
             _f("dir", "path", "where W&B keeps its files (a `wandb/` folder is made inside)",
                default_text="`<job_dir>`")),
    _tracker("mlflow", "one MLflow run per job, resumed by every incarnation (its id is kept in the job "
             "directory)",
             _f("tracking_uri", "str", "the tracking store: `sqlite:///PATH`, or an `http(s)://` tracking server",
                default_text="`sqlite:///<job_dir>/mlflow.db`"),
             _f("experiment", "str", "the experiment (made when missing)", default_text="the job's name"),
             _f("artifact_location", "path", "where a new experiment keeps its artifacts (`clusterops/events.txt`); "
                "an existing experiment keeps its own", default_text="`mlflow-artifacts/` beside a `sqlite:///` "
                "store; the server's choice otherwise"),
             _f("run_name", "str", "the run's name", default_text="`<name>-<job id>`")),
)


SUPERVISE = Field("supervise", "map", "run under `clusterops supervise` (self-healing); a mapping of the "
                  "keys below, or `true` for the defaults", fields=(
    _f("ckpt_dir", "path", f"checkpoint root (`{ENV_CKPT_DIR}`); relative to `workdir`",
       default_text="`<workdir>/checkpoints`"),
    _f("job_dir", "path", "the supervisor's timeline and state; relative to `workdir`",
       default_text="`<log_dir>/<name>-<job id>`"),
    _f("job_dir_mode", "str", "mode of the job directory when the supervisor creates it: "
       + ", ".join(f"`{m}`" for m in JOB_DIR_MODES) + " (the attempts' directories, which hold the "
       "heartbeat token, stay 0700 whatever it says)", default="0700"),
    _budget("spare_nodes", "extra nodes allocated to replace bad ones", 0, flags=("--spares",)),
    _policy("min_nodes", "int", "continue on fewer nodes, down to this many (at most `nodes`), instead of "
            "requeueing", min=1, max=MAX_COUNT, default_text="`nodes`", flags=("--nodes-min",)),
    _timeout("hang_timeout_s", "no heartbeat progress from a rank for this long is a hang (make it longer "
             "than a save)", 300.0),
    _timeout("startup_timeout_s", "time a rank gets to its first heartbeat", 600.0),
    _timeout("stop_timeout_s", "seconds the ranks get to checkpoint and stop; shorter than `signal_lead_s`",
             120.0),
    _timeout("kill_timeout_s", "time a killed step gets to go away before it is killed harder", 30.0),
    _budget("max_restarts", "restarts inside the allocation (per incarnation) before requeueing or giving up",
            5),
    _budget("max_requeues", "requeues (`SLURM_RESTART_COUNT`) before giving up", 3),
    _budget("no_progress_restarts", "restarts in a row without a newer checkpoint before giving up (exit 3); "
            "0: give up at the first failure that saved nothing new", 3),
    _policy("preflight", "profile", "health profile (name or YAML path) run on every node before the first "
            "launch; `false` skips it", "preflight", default_text="`preflight`"),
    _timeout("preflight_timeout_s", "time limit of the preflight check", 180.0),
    _policy("postmortem", "profile", "health profile run on the step's nodes after a failure (else the "
            "liveness check)", default_text="off"),
    _policy("liveness_check", "bool", "after a failure without a `postmortem` profile, check that every node "
            "still answers", True),
    _timeout("liveness_timeout_s", "time limit of that liveness check", 10.0),
    _policy("hang_blame_margin_s", "number", "blame a hung rank only when it fell silent this long before the "
            "others", 5.0, min=0),
    _policy("drain_bad_nodes", "bool", "drain nodes judged bad, with a `clusterops:` reason", False),
    _budget("node_fail_threshold", "failures blamed on one node before it is dropped", 2, lo=1),
    _policy("detect_stragglers", "bool", "watch the ranks' busy time per step (heartbeats) for a node "
            "consistently slower than the others, and record it (timeline `straggler`, metrics)", True),
    _policy("straggler_ratio", "number", "a node is slow when its busy time per step is at least this many times "
            "the median of the other nodes'", 1.5, min=1, gt=True),
    _policy("straggler_window", "int", "beats (about one a second) a node's figure is the median of, and "
            "evaluations in a row it must stay slow before it is named", 10, min=1, max=1000),
    _budget("straggler_warmup_steps", "steps after each (re)start that are not measured", 20),
    _policy("replace_stragglers", "bool", "when a straggler is found and a spare node is free: stop the ranks "
            "with a checkpoint, relaunch on the spare without the slow node (no step lost), keep it out (drained "
            "with a `clusterops:straggler:` reason when `drain_bad_nodes`); without a spare only record it", False),
    _f("exit_codes", "exitcodes", "what a training step's exit code asks: `{CODE: ACTION}` with actions "
       + ", ".join(f"`{a}`" for a in EXIT_ACTIONS) + " (docs/supervisor.md, \"Exit codes as a contract\"); "
       "merged over the defaults 16: relaunch_without_suspects (Megatron-LM), 17: stop (Megatron-LM), "
       "93: stop (nvidia-resiliency-ext)", default_text="16, 17, 93 as named"),
    _policy("drain_grace_s", "number", "a node of the job drained by someone else (a reason clusterops did not "
            "write) with no spare to take its place: stop with a checkpoint and requeue without it this long after "
            "the drain was seen (the stop starts `stop_timeout_s` earlier); 0: keep running on it", 0.0, min=0),
    _budget("replica_check_every", "steps between the replica checks of a script that calls "
            "`sdk.check_replicas` (a digest of every rank's parameters compared across the replicas; a rank "
            "that differs is an `sdc_suspect`: rolled back to the last agreeing check, its node kept out); 0: off",
            100),
    _f("verify_deep", "bool", "hash-check the checkpoint a restart resumes from, not only sizes (a flipped "
       "byte is caught, not loaded)", default=True),
    _f("step_wait_s", "int", "`srun --wait` for the supervisor's training steps", min=1, max=86400,
       default_text="`srun_wait_s`"),
    _f("inprocess", "map", "in-process recovery, for a script that trains through `clusterops.recover.run`: "
       "a lost rank is replaced by a warm standby inside the running step, its state broadcast from a survivor "
       "(docs/supervisor.md, \"In-process recovery\"); the full relaunch stays the fallback",
       default_text="off (every fault relaunches the step)", fields=(
        _f("standbys_per_node", "int", "warm standby processes per node (the script imported, waiting for a "
           "rank); a lost rank takes one on its own node, else one on another node", default=1, min=1, max=64),
        seconds("timeout_s", "the new generation's first step must come within this long of the fault, "
                "else the step is relaunched", 30.0),
        seconds("unresponsive_s", "a rank that neither rejoins nor dies this long after a fault is killed by "
                "its node's standby", 10.0),
        _f("refill", "bool", "once a standby has taken a lost rank's place and the new generation trains, start "
           "a new standby on that node (`srun --overlap`, a step of its own) while the node answers, so a second "
           "fault there heals in-process too", default=True),
    )),
    # A script without the SDK (docs/supervisor.md, "Scripts without the SDK").
    _f("progress", "map", "no SDK: read progress from the ranks' output instead of heartbeat files; a hang is "
       "no new step for `hang_timeout_s`", default_text="off (SDK heartbeats)", fields=(
        _f("regex", "regex", "searched in every output line; group 1 is the step", required=True),
        _f("loss_regex", "regex", "for the stability guard: searched in every output line; group 1 is the loss "
           "(`nan`/`inf` read as such)", default_text="off"),
    )),
    _f("checkpoint_glob", "str", "no SDK: the script's own checkpoints, a glob under `ckpt_dir`; the newest "
       "complete one (highest last number in its name, not a temporary name) is resumed from",
       default_text="off (SDK checkpoints)"),
    Field("resume_args", "list", "no SDK: arguments added to the command on a restart when there is a "
          "checkpoint; `{ckpt}` is replaced by its path, `{skip_batches}` and `{lr_factor}` by a stability "
          "rollback's decision (0 and 1 otherwise)", default_text="none", item=Field("item", "text")),
    Field("trackers", "trackers", "experiment trackers told what the supervisor sees: restarts, rollbacks, "
          "requeues, stragglers, lost nodes as markers; goodput, steps lost, recovery seconds and the guard's "
          "loss as scalars (docs/trackers.md); a list of `{kind: tensorboard|wandb|mlflow, ...}`",
          default_text="none", options=TRACKER_FIELDS),
    _f("stability", "map", "the stability guard: watch the loss (and grad norm) the ranks report for spikes and "
       "non-finite values, and record, stop or roll back (docs/supervisor.md, \"Training stability\")",
       default_text="off", fields=STABILITY_FIELDS),
))

# Policy fields that are not `supervise:` keys: a job spec sets them elsewhere (its node
# count, ranks per node, `requeue`), or they are the supervisor's own.
POLICY_ONLY: Tuple[Field, ...] = (
    _policy("nodes", "int", "training nodes (the spec's `nodes`; else the allocation minus the spares)", 1,
            min=1, max=MAX_COUNT),
    _policy("ranks_per_node", "int", "training processes per node (the spec's ranks per node)", 1, min=1,
            max=4096),
    _policy("requeue", "bool", "may the supervisor requeue the job at all (the spec's `requeue`)", True),
    _timeout("progress_interval_s", "how often progress samples go to the timeline", 2.0),
)


def policy_fields() -> Tuple[Field, ...]:
    """The supervisor's Policy, field by field (the dataclass is made from this)."""
    return POLICY_ONLY + tuple(f for f in SUPERVISE.fields if f.policy)


def supervise_field(name: str) -> Optional[Field]:
    return next((f for f in SUPERVISE.fields if f.name == name), None)


def _text_list(name: str, doc: str, item: str = "str") -> Field:
    return Field(name, "list", doc, default_text="none", item=Field("item", item))


JOB_SPEC = Field("job spec", "map", fields=(
    _f("name", "str", "job name (`--job-name`); no control characters, `/`, `%` or `\\`", required=True),
    _f("nodes", "int", "nodes the training runs on", required=True, min=1, max=MAX_COUNT),
    _f("launcher", "str", "`torchrun` | `accelerate` | `deepspeed` | `srun`, or the name of a site template",
       required=True),
    _f("script", "path", "the training script, relative to `workdir`; must exist and be readable on the submit "
       "host (not checked with `container_image`); not a `.py`: executable, for `srun`", required=True),
    _text_list("args", "arguments for the script, passed literally", item="text"),
    Field("env", "dict", "environment variables, exported (quoted) before `setup`", default_text="none",
          item=Field("value", "text")),
    _f("gpus_per_node", "int", "GPUs per node (`--gpus-per-node`)", default=0, min=0, max=1024),
    _f("nproc_per_node", "int", "ranks per node", min=1, max=4096,
       default_text="`gpus_per_node`, else `cpus_per_task` for torchrun/accelerate/deepspeed, else 1"),
    _f("cpus_per_task", "int", "CPUs per task (`--cpus-per-task`): per node for the launchers (one task per "
       "node), per rank for `srun`", min=1, max=4096),
    _f("mem", "mem", "memory per node (`--mem`), e.g. `200G`, `64000M`; `0` = all of it"),
    _f("time", "time", "time limit: `M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S` or `UNLIMITED`"),
    _f("partition", "str", "`--partition`"),
    _f("account", "str", "`--account`"),
    _f("qos", "str", "`--qos`"),
    _f("exclusive", "bool", "whole nodes (`--exclusive`)", default=False),
    _f("exclude", "hostlist", "nodes never to use (`--exclude`); a string or a list"),
    _f("nodelist", "hostlist", "nodes to use (`--nodelist`); a string or a list"),
    _f("constraint", "str", "node features (`--constraint`)"),
    _f("segment", "int", "nodes per topology segment (`--segment`, Slurm 24.05+ with topology/block): the "
       "job's nodes, spares included, come in groups of this many, each group within one block; a divisor "
       "of them, at most the partition's nodes (checked at submit)", min=1, max=100000),
    _f("workdir", "path", "the job's working directory (`--chdir`); relative to the spec file's directory",
       default_text="the spec file's directory"),
    _f("log_dir", "path", "batch log, per-node logs and the submitted script (created by `submit`)",
       default_text="`<workdir>/logs`"),
    _f("container_image", "str", "pyxis/enroot image: `srun --container-image`"),
    _f("container_mounts", "str", "pyxis `--container-mounts`"),
    _f("setup", "lines", "shell lines run in the batch shell before the launch (module loads, venv "
       "activation); a list or a block; verbatim. The environment they set reaches every node through srun",
       default_text="none"),
    _f("signal_lead_s", "int", "seconds before the time limit to send SIGUSR1 (`--signal=B:USR1@N`), forwarded "
       "to the training processes; 0 = off; below the time limit", default=600, min=0, max=65535,
       default_text="600, or half the time limit when that is shorter"),
    _f("requeue", "union", "`--requeue` / `--no-requeue`; `expedite`: `--requeue=expedite` (Slurm 25.11+ with "
       "`SlurmctldParameters=enable_expedited_requeue`, checked at submit): a requeued job is eligible at once, "
       "at the top of the queue. A supervised job gets `expedite` by itself where the cluster allows it",
       default=False, options=(_f("requeue", "bool"), _f("requeue", "enum", choices=("expedite",))),
       default_text="false; true with `supervise` (`expedite` where the cluster allows it)"),
    _f("chain", "int", "run as a chain of N jobs one after another (`--array=1-N%1`); with `supervise:` a chain of "
       "generations that resume one another and end together (needs `supervise.ckpt_dir`)", default=1, min=1,
       max=1000),
    _f("master_port", "int", "fixed rendezvous port", min=1024, max=65535,
       default_text="derived from the job id"),
    _f("srun_wait_s", "int", "`srun --wait`: seconds the other tasks get once one has ended; 0 = no limit",
       default=60, min=0, max=86400),
    _f("python", "str", "interpreter for `.py` scripts under the `srun` launcher", default="python3",
       default_text="`python3`"),
    _text_list("launcher_args", "extra arguments for torchrun/accelerate/deepspeed, before the script"),
    _text_list("srun_args", "extra srun arguments for the training step"),
    _text_list("sbatch_args", "extra `#SBATCH` lines, one long option each (`--mail-type=END`)"),
    _text_list("notify", "webhook URLs (http/https) told, as a generic JSON POST, when the supervised job is "
               "requeued or gives up; the site config's `notify:` webhooks are told too"),
    SUPERVISE,
))


def job_spec_field(name: str) -> Optional[Field]:
    return next((f for f in JOB_SPEC.fields if f.name == name), None)


# -- dataclasses from a table (the supervisor's Policy) -------------------------------------

_PY_TYPES = {"int": int, "number": float, "bool": bool, "str": str, "path": str, "profile": str, "enum": str}


def dataclass_of(fields: Sequence[Field], **options: Any):
    """Class decorator: make ``cls`` a dataclass whose fields, types and defaults are
    ``fields`` (in order), ahead of any the class declares itself."""
    def make(cls):
        annotations: Dict[str, Any] = {}
        for f in fields:
            t = _PY_TYPES[f.kind]
            annotations[f.name] = t if f.default is not None else Optional[t]
            setattr(cls, f.name, f.default)
        annotations.update(cls.__dict__.get("__annotations__", {}))
        cls.__annotations__ = annotations
        return dataclasses.dataclass(**options)(cls)
    return make


# -- validation ------------------------------------------------------------------------------

def suggest(word: str, options: Sequence[str]) -> str:
    m = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


# How a key path reads in a message (``a.b[2]``): written once, in the loader, which names
# keys in its own errors before any schema is asked.
key_text = yamlio.key_text
_dotted = yamlio.dotted


class _Where:
    def __init__(self, source: str, lines: Mapping[Path_, int], prefix: Path_):
        self.source, self.lines, self.prefix = source, lines, prefix

    def error(self, path: Path_, message: str) -> InputError:
        full = self.prefix + path
        line = None
        p = full
        while p:
            if p in self.lines:
                line = self.lines[p]
                break
            p = p[:-1]
        loc = f"{self.source}:{line}" if line is not None else self.source
        key = _dotted(full)
        return InputError(f"{loc}: {key}: {message}" if key else f"{loc}: {message}")


def _name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# -- the one interpreter of the field kinds -------------------------------------------------
#
# ``Checker.check(value, field, path)`` walks a value by its field, dispatching on the
# field's kind through a registry (kind name -> function). Three inputs share it, each with
# its registry and the wording its tests and users know:
#
# - ``KINDS``: health profiles and the site config (``validate``);
# - ``POLICY_KINDS``: an object's attributes, e.g. the supervisor's Policy (``problems``);
# - the job spec's registry in ``clusterops.launch.spec``, which extends ``KINDS`` with its
#   own kinds (path, hostlist, time, mem, lines) and reads its text values as written.
#
# A new field kind is one function registered here (or in the job spec's registry when only
# the job spec has it); ``Field.type_text`` names it for the docs and messages.

KindCheck = Callable[["Checker", Any, Field, Path_], Any]


class Checker:
    """One walk over a value by its field: ``check(value, field, path)`` returns the value
    (converted where the kind converts) or raises the ``InputError`` that ``error`` makes."""

    def __init__(self, kinds: Mapping[str, KindCheck], error: Callable[[Path_, str], InputError]):
        self.kinds = kinds
        self._error = error

    def error(self, path: Path_, message: str) -> InputError:
        return self._error(path, message)

    def null(self, f: Field, path: Path_) -> bool:
        """A null value: True when it stands (the walk returns None), an error when refused;
        False hands it to the kind."""
        if f.nullable or f.kind in ("probe", "any", "map", "dict"):  # map/dict: an empty section
            return True
        raise self.error(path, f"must be {f.type_text()}, got null")

    def check(self, value: Any, f: Field, path: Path_ = ()) -> Any:
        if value is None and self.null(f, path):
            return None
        kind = self.kinds.get(f.kind)
        if kind is None:
            raise AssertionError(f"no check for kind {f.kind!r}")   # a table/registry mismatch
        return kind(self, value, f, path)


def _want(f: Field) -> str:
    rng = f.range_text()
    return ("a whole number" if f.kind == "int" else "a number") + (
        (" in " if rng.startswith(("[", "(")) else " ") + rng if rng else "")


def _out_of_range(v: Any, f: Field) -> bool:
    lo, hi = f.min, f.max
    return (lo is not None and (v <= lo if f.gt else v < lo)) or (hi is not None and v > hi)


def _k_bool(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not isinstance(v, bool):
        raise c.error(path, f"must be true or false, got {_name(v)}")
    return v


def _k_number(c: Checker, v: Any, f: Field, path: Path_, finite_note: str = " (finite)") -> Any:
    want = _want(f)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (f.kind == "int" and not isinstance(v, int)):
        raise c.error(path, f"must be {want}, got {_name(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise c.error(path, f"must be {want}{finite_note}, got {_name(v)}")
    if _out_of_range(v, f):
        raise c.error(path, f"must be {want}, got {_name(v)}")
    return v


def _k_str(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not isinstance(v, str):
        raise c.error(path, f"must be a string, got {_name(v)}")
    if not v.strip():
        raise c.error(path, "must not be empty")
    return v


def _k_url(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    from clusterops.notify import url_problem   # the one webhook URL rule

    why = url_problem(v)
    if why is not None:
        raise c.error(path, why)   # the URL itself is not echoed: its path is often the secret
    return v


def _k_enum(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if v not in f.choices or isinstance(v, bool):
        raise c.error(path, f"must be one of {', '.join(map(str, f.choices))}, got {_name(v)}"
                            f"{suggest(v, f.choices) if isinstance(v, str) else ''}")
    return v


def _k_version(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not re.fullmatch(r"\d+(\.\d+)*", str(v)):
        raise c.error(path, f"must be a version like \"550.54.15\" (quote it), got {_name(v)}")
    return v


def _k_regex(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not isinstance(v, str):
        raise c.error(path, f"must be a regular expression (a string), got {_name(v)}")
    try:
        re.compile(v)
    except re.error as e:
        raise c.error(path, f"bad regular expression {v!r}: {e}") from None
    return v


def _k_list(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not isinstance(v, list):
        raise c.error(path, f"must be a {f.type_text()}, got {_name(v)}")
    if len(v) < f.min_len or (f.max_len is not None and len(v) > f.max_len):
        want = (f"exactly {f.min_len}" if f.min_len == f.max_len else
                f"at least {f.min_len}" if f.max_len is None else f"{f.min_len} to {f.max_len}")
        raise c.error(path, f"must have {want} items, got {len(v)}")
    if f.item is not None:
        for i, item in enumerate(v):
            c.check(item, f.item, path + (i,))
    return v


def _k_union(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    errors = []
    for opt in f.options:
        try:
            return c.check(v, opt, path)
        except InputError as e:
            errors.append(e)
    # The option of the value's own shape explains best.
    for opt, e in zip(f.options, errors):
        if (opt.kind == "map" and isinstance(v, dict)) or (opt.kind in ("str", "url") and isinstance(v, str)):
            raise e
    raise c.error(path, f"must be {f.type_text()}, got {_name(v)}")


def _k_probe(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if v is False:
        return v
    if not isinstance(v, dict):
        raise c.error(path, f"must be a mapping of settings, or false to disable the probe, got {_name(v)}")
    return _check_map(c, v, f, path, "setting")


def _k_map(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not isinstance(v, dict):
        raise c.error(path, f"must be a mapping, got {_name(v)}")
    return _check_map(c, v, f, path, "probe" if f.name == "probes" else "key")


def _k_dict(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not isinstance(v, dict):
        raise c.error(path, f"must be a mapping, got {_name(v)}")
    for key, item in v.items():
        if not isinstance(key, str) or not key.strip():
            raise c.error(path + (key,), "names must be non-empty strings")
        if f.item is not None:
            c.check(item, f.item, path + (key,))
    return v


def _check_map(c: Checker, v: Dict[Any, Any], f: Field, path: Path_, what: str) -> Any:
    known = {x.name: x for x in f.fields}
    for key, item in v.items():
        if key not in known:
            valid = ", ".join(known)
            raise c.error(path + (key,), f"unknown {what}{suggest(key, known)}; "
                                         f"{'known' if what == 'probe' else 'valid'}: {valid}")
        c.check(item, known[key], path + (key,))
    for x in f.fields:
        if x.required and x.name not in v:
            raise c.error(path, f"missing {x.name}")
    return v


def _k_exitcodes(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    """``{CODE: ACTION}``: codes 1-255 (an int, or digits as YAML may quote them), actions
    from :data:`EXIT_ACTIONS`; -> ``{int: action}``."""
    if not isinstance(v, dict):
        raise c.error(path, f"must be a mapping of exit code -> action, got {_name(v)}")
    out = {}
    for key, action in v.items():
        code = key if isinstance(key, int) and not isinstance(key, bool) else (
            int(key) if isinstance(key, str) and key.strip().isdigit() else None)
        if code is None or not 1 <= code <= 255:
            raise c.error(path + (key,), f"exit codes are whole numbers from 1 to 255, got {key!r}")
        if action not in EXIT_ACTIONS:
            raise c.error(path + (key,), f"unknown action {action!r}{suggest(str(action), EXIT_ACTIONS)}; "
                                         f"valid: {', '.join(EXIT_ACTIONS)}")
        out[code] = action
    return out


def _k_trackers(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    """``[{kind: KIND, ...}, ...]``: each item walked by its kind's map (``f.options``)."""
    if not isinstance(v, list):
        raise c.error(path, f"must be a list of mappings, each with kind: {' | '.join(TRACKER_KINDS)}; "
                            f"got {_name(v)}")
    by_kind = {o.name: o for o in f.options}
    out = []
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            raise c.error(path + (i,), f"must be a mapping with kind: {' | '.join(by_kind)}, got {_name(item)}")
        kind = item.get("kind")
        if kind not in by_kind or isinstance(kind, bool):
            raise c.error(path + (i, "kind"), f"must be one of {', '.join(by_kind)}, got {_name(kind)}"
                                              f"{suggest(kind, list(by_kind)) if isinstance(kind, str) else ''}")
        out.append(c.check(item, by_kind[kind], path + (i,)))
    return out


#: The kinds of the health profiles and the site config (``validate``).
KINDS: Dict[str, KindCheck] = {
    "exitcodes": _k_exitcodes, "trackers": _k_trackers,
    "bool": _k_bool, "int": _k_number, "number": _k_number, "str": _k_str, "url": _k_url,
    "enum": _k_enum, "version": _k_version, "regex": _k_regex, "list": _k_list, "union": _k_union,
    "probe": _k_probe, "map": _k_map, "dict": _k_dict, "any": lambda c, v, f, path: v,
}


def _k_nonempty(c: Checker, v: Any, f: Field, path: Path_) -> Any:
    if not (isinstance(v, str) and v.strip()):
        raise c.error(path, f"must be a non-empty string, got {_name(v)}")
    return v


#: The kinds of an object's attributes (``problems``: the supervisor's Policy).
POLICY_KINDS: Dict[str, KindCheck] = {
    "bool": _k_bool, "int": _k_number, "number": lambda c, v, f, path: _k_number(c, v, f, path, ""),
    "str": _k_nonempty, "path": _k_nonempty, "profile": _k_nonempty,
}


class _PolicyChecker(Checker):
    def null(self, f: Field, path: Path_) -> bool:
        if f.default is None or f.kind == "profile":   # no default: None is fine; a profile: None is off
            return True
        return False


def problems(obj: Any, fields: Sequence[Field]) -> List[str]:
    """``name: must be ...`` for each attribute of ``obj`` that breaks its field's type or
    bounds (None is fine where the field has no default)."""
    c = _PolicyChecker(POLICY_KINDS, lambda path, message: InputError(f"{_dotted(path)}: {message}"))
    bad = []
    for f in fields:
        if f.kind not in POLICY_KINDS:
            continue
        try:
            c.check(getattr(obj, f.name), f, (f.name,))
        except InputError as e:
            bad.append(str(e))
    return bad


def validate(data: Any, schema: Field, source: str, lines: Optional[Mapping[Path_, int]] = None,
             prefix: Path_ = ()) -> None:
    """Check ``data`` against ``schema``; raise InputError ``file:line: key.path: message``."""
    w = _Where(source, lines or {}, prefix)
    if data is not None and not isinstance(data, dict) and schema.kind == "map":
        raise w.error((), f"a {schema.name} file is a YAML mapping of keys, got {_name(data)}")
    Checker(KINDS, w.error).check(data, schema, ())


def defaults_of(f: Field) -> Dict[str, Any]:
    return {x.name: x.default for x in f.fields if x.default is not None}


# -- docs ------------------------------------------------------------------------------------

def _rows(f: Field, prefix: str) -> list:
    rows = []
    for x in f.fields:
        key = f"{prefix}{x.name}"
        if x.kind in ("map",) and x.fields:
            rows.append((key, "mapping", "", x.doc))
            rows += _rows(x, key + ".")
        elif x.kind == "list" and x.item is not None and x.item.kind == "map":
            rows.append((key, "list of mappings", _default_text(x), x.doc))
            rows += _rows(x.item, key + "[].")
        elif x.kind == "list" and x.item is not None and x.item.kind == "union":
            rows.append((key, "list of (path or mapping)", _default_text(x), x.doc))
            for o in x.item.options:
                if o.kind == "map":
                    rows += _rows(o, key + "[].")
        else:
            rows.append((key, x.type_text(), _default_text(x), x.doc))
    return rows


def _default_text(x: Field) -> str:
    if x.default is None:
        return ""
    if isinstance(x.default, bool):
        return "true" if x.default else "false"
    return f"{x.default}"


def markdown_table(rows: list) -> str:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, doc in rows:
        cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        out.append(f"| `{key}` | {cell(typ)} | {cell(default)} | {cell(doc)} |")
    return "\n".join(out)


def docs_tables() -> Dict[str, str]:
    """Name -> markdown table, as embedded in docs/health.md between ``<!-- schema:NAME -->`` marks."""
    tables = {
        "profile": markdown_table(_rows(Field("p", "map", fields=PROFILE.fields[:3]), "")),
        "probe-common": markdown_table(_rows(Field("c", "map", fields=COMMON_SETTINGS), "")),
    }
    for name, fields in PROBE_SETTINGS.items():
        tables[f"probe-{name}"] = markdown_table(_rows(Field(name, "map", fields=fields), ""))
    tables["site"] = markdown_table(
        [("gpu_models.<MODEL>", "mapping", "", "merged over the built-in gpu_models.yaml")]
        + _rows(GPU_MODEL, "gpu_models.<MODEL>.")
        + [("defaults", "mapping (gpus, probes)", "", "merged into every profile"),
           ("profiles.<NAME>", "mapping (description, gpus, probes)", "", "overrides for one profile")]
        + [("drain", "mapping", "", DRAIN.doc)] + _rows(DRAIN, "drain.")
        + [("history", "mapping", "", HISTORY.doc)] + _rows(HISTORY, "history.")
        + [("quarantine", "mapping", "", QUARANTINE.doc)] + _rows(QUARANTINE, "quarantine.")
        + [("notify", "list of URL or webhook", "", NOTIFY.doc)] + _rows(WEBHOOK, "notify[].")
        + [("slurm", "mapping", "", SLURM.doc)] + _rows(SLURM, "slurm.")
    )
    return tables


def default_doc(x: Field) -> str:
    """A field's default as the docs and the --help texts show it."""
    if x.required:
        return "required"
    if x.default_text:
        return x.default_text
    if isinstance(x.default, float):
        return f"{x.default:g}"
    return _default_text(x)


def _spec_type(x: Field) -> str:
    if x.kind == "map":
        return "mapping or true"
    if x.kind == "hostlist":
        return "hostlist"
    return x.type_text()


def cli_flags(f: Field) -> Tuple[str, ...]:
    """The command-line names of a Policy or supervise field: ``--name-with-dashes`` first."""
    return ("--" + f.name.replace("_", "-"),) + f.flags


def _flag_cell(f: Field) -> str:
    names = cli_flags(f)
    if f.kind == "bool":
        names = tuple(f"{n}/--no-{n[2:]}" for n in names[:1]) + names[1:]
    return ", ".join(f"`{n}`" for n in names)


def launch_docs_tables() -> Dict[str, str]:
    """The key tables of docs/launch.md: the job spec and its supervise: section."""
    return {
        "job-spec": markdown_table([(x.name, _spec_type(x), default_doc(x), x.doc) for x in JOB_SPEC.fields]),
        "supervise": markdown_table([(x.name, x.type_text(), default_doc(x), x.doc) for x in SUPERVISE.fields]),
    }


def supervisor_docs_tables() -> Dict[str, str]:
    """The settings table of docs/supervisor.md: every supervise key and Policy field, with its flag."""
    out = ["| key | flag of `clusterops supervise` | type | default | meaning |", "|---|---|---|---|---|"]
    cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    for x in SUPERVISE.fields + POLICY_ONLY:
        key = f"`{x.name}`" if x in SUPERVISE.fields else "(not a key)"
        out.append(f"| {key} | {_flag_cell(x)} | {cell(x.type_text())} | {cell(default_doc(x))} | {cell(x.doc)} |")
    stab = markdown_table([(f"stability.{x.name}", x.type_text(), default_doc(x), x.doc) for x in STABILITY_FIELDS])
    return {"supervise-settings": "\n".join(out), "stability": stab}


def trackers_docs_tables() -> Dict[str, str]:
    """The keys of each tracker kind, as docs/trackers.md shows them."""
    rows = []
    for t in TRACKER_FIELDS:
        rows += [(f"{t.name}: {x.name}", x.type_text(), "required" if x.name == "kind" else default_doc(x),
                  x.doc if x.name != "kind" else f"`{t.name}`: {t.doc}") for x in t.fields]
    return {"trackers": markdown_table(rows)}


# docs file (relative to the project root) -> its generated tables
DOC_TABLES = {
    "docs/health.md": docs_tables,
    "docs/launch.md": launch_docs_tables,
    "docs/supervisor.md": supervisor_docs_tables,
    "docs/trackers.md": trackers_docs_tables,
}


def _block(name: str, table: str) -> str:
    return f"<!-- schema:{name} -->\n{table}\n<!-- /schema:{name} -->"


def render_docs(tables: Optional[Dict[str, str]] = None) -> str:
    tables = docs_tables() if tables is None else tables
    return "\n\n".join(_block(name, table) for name, table in tables.items())


def sync_docs(root: Any, write: bool = False) -> List[str]:
    """Compare (or, with ``write``, rewrite) the generated tables in the docs under ``root``.
    Returns ``file: schema:NAME`` for each table that is missing or differs."""
    from pathlib import Path

    drift = []
    for rel, make in DOC_TABLES.items():
        path = Path(root) / rel
        text = original = path.read_text()
        for name, table in make().items():
            m = re.search(rf"<!-- schema:{re.escape(name)} -->\n.*?\n<!-- /schema:{re.escape(name)} -->",
                          text, re.S)
            if m is None:
                drift.append(f"{rel}: schema:{name} (no such block)")
                continue
            if m.group(0) != _block(name, table):
                drift.append(f"{rel}: schema:{name}")
                text = text[:m.start()] + _block(name, table) + text[m.end():]
        if write and text != original:
            path.write_text(text)
    return drift


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m clusterops.schema [--check|--write] [ROOT]``: print the health tables, or
    check / rewrite every generated table in ROOT's docs (default: the current directory)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    mode = args.pop(0) if args and args[0] in ("--check", "--write") else None
    if mode is None:
        print(render_docs())
        return 0
    drift = sync_docs(args[0] if args else ".", write=mode == "--write")
    for d in drift:
        print(("rewrote " if mode == "--write" else "differs: ") + d)
    return 1 if drift and mode == "--check" else 0


if __name__ == "__main__":
    raise SystemExit(main())
