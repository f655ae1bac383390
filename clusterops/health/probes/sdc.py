"""Silent data corruption (``sdc``): a fixed-seed workload whose digest must be bitwise stable.

The workload is a chain of GEMMs on seeded random matrices with a float reduction after
each one. Every intermediate result is folded into exact integer checksums (the float
bits viewed as integers, split into 16-bit halves, plain and position-weighted sums in
int64): integer sums do not depend on the order of the reduction, so the checksum is as
deterministic as the GEMM itself, and one flipped bit anywhere in a result changes it.
The digest is a hash of those checksums and of the last result's row sums.

The same code runs on each CUDA device (bf16 by default: the tensor cores) or, on a
CPU-only node, on the CPU (fp32, one thread, ``torch.use_deterministic_algorithms``).
The digest only means something next to others of the same *model key*: the GPU name and
SM count, the driver and the torch build (cuBLAS picks its kernels by all of them); on the
CPU ``cpu:<torch version>:<machine arch>:<cpu model>``. The probe passes when every device
gives the digest recorded for its key (``expected`` in the profile or site config, then
the data file ``digests_file``, default ``health/sdc_digests.yaml``) or when none is
recorded; it fails on a mismatch with a recorded value or when the node's own devices of
one key disagree. Comparing nodes with each other is the sweep's part
(``clusterops.sweep.results.mark_sdc_outliers``). A crash is an ``error`` (the runner's),
never a fail.

Test hook: ``CLUSTEROPS_SDC_FAULT=flip:<bit>[@<node>]`` flips bit ``<bit>`` of the first
element of the first GEMM's result (only on ``<node>`` when named), so a dev cluster can
show a bad node. It is a test hook: never set it in production.
"""

from __future__ import annotations

import hashlib
import os
import platform
import struct
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from clusterops.health.probes.base import ProbeContext, ProbeResult

FAULT_ENV = "CLUSTEROPS_SDC_FAULT"
# Bumped whenever the workload changes: recorded digests are keyed by it.
WORKLOAD_VERSION = 1
DEFAULTS = {"size": 256, "iterations": 8, "seed": 29, "gpu_dtype": "bfloat16"}


def workload_id(size: int, iterations: int, seed: int, dtype: str) -> str:
    """The recorded digests' key for one workload: a digest is only comparable under the same one."""
    return f"v{WORKLOAD_VERSION} size={size} iterations={iterations} seed={seed} dtype={dtype}"


def parse_fault(spec: Optional[str], node: str) -> Optional[int]:
    """The bit to flip from ``flip:<bit>[@<node>]``, or None (unset, or aimed at another node).
    A malformed value raises ValueError (the probe then errors: a hook typo must not pass)."""
    if not spec:
        return None
    what, _, target = spec.partition("@")
    kind, _, bit = what.partition(":")
    if kind != "flip" or not bit.isdigit() or not 0 <= int(bit) < 32:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected flip:<bit 0-31>[@<node>]")
    if target and target != node:
        return None
    return int(bit)


def _flip(torch, y, bit: int):
    """``y`` with one bit of its first element flipped (in place on a copy)."""
    y = y.clone()
    ibits = {2: torch.int16, 4: torch.int32}[y.element_size()]
    flat = y.view(-1).view(ibits)
    width = 8 * y.element_size()
    mask = 1 << (bit % width)
    if mask >= 1 << (width - 1):
        mask -= 1 << width     # the sign bit, as a signed integer of that width
    flat[0] = flat[0] ^ mask
    return y


def _checksums(torch, y) -> List[Any]:
    """Exact, order-independent integer sums of ``y``'s bits (device tensors, no transfer)."""
    ibits = {2: torch.int16, 4: torch.int32}[y.element_size()]
    bits = y.contiguous().view(-1).view(ibits).to(torch.int64)
    halves = [bits & 0xFFFF] + ([(bits >> 16) & 0xFFFF] if y.element_size() == 4 else [])
    # Position weights < 2^8 keep every sum below 2^63 for any size the schema allows.
    w = (torch.arange(bits.numel(), device=y.device, dtype=torch.int64) % 251) + 1
    out = []
    for h in halves:
        out += [h.sum(), (h * w).sum()]
    return out


def digest(torch, device: str, *, size: int, iterations: int, seed: int, dtype, flip_bit: Optional[int] = None
           ) -> str:
    """The workload's digest on ``device`` (hex, 32 characters). Deterministic for one model key."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(size, size, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device, dtype=torch.float32).to(dtype)
    scale = 1.0 / float(size) ** 0.5      # keeps the chain's values near unit variance
    sums: List[Any] = []
    x = a
    for i in range(iterations):
        y = torch.matmul(x, b)
        if i == 0 and flip_bit is not None:
            y = _flip(torch, y, flip_bit)
        rows = y.float().sum(dim=1)          # a float reduction, checked bit for bit too
        sums += _checksums(torch, y) + _checksums(torch, rows)
        x = (y * scale).to(dtype)
    values = torch.stack(sums).cpu().tolist()
    h = hashlib.sha256(f"sdc v{WORKLOAD_VERSION}".encode())
    h.update(struct.pack(f"<{len(values)}q", *values))
    h.update(rows.cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def cpu_model_key(torch) -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = " ".join(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return f"cpu:{torch.__version__}:{platform.machine()}:{cpu or 'unknown'}"


def _driver(ctx: ProbeContext, torch) -> str:
    """The NVIDIA driver version through NVML, else the CUDA driver API version torch sees."""
    try:
        from clusterops.health.probes.nvml import load_nvml

        nv = load_nvml(ctx)
        nv.nvmlInit()
        v = nv.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no NVML: a coarser key is still a key
        get = getattr(torch._C, "_cuda_getDriverVersion", None)
        return f"api{get()}" if get else "unknown"


def gpu_model_key(torch, index: int, driver: str) -> str:
    p = torch.cuda.get_device_properties(index)
    return f"{p.name} sm{p.multi_processor_count}:driver {driver}:torch {torch.__version__}"


def load_recorded(path: str) -> Dict[str, Dict[str, str]]:
    """The digests file: ``{workloads: {<workload id>: {<model key>: <hex digest>}}}``; bad -> InputError."""
    from clusterops import schema, yamlio

    data, lines = yamlio.load_file(Path(path), "sdc digests file")
    schema.validate(data or {}, DIGESTS_FILE, str(path), lines)
    return dict((data or {}).get("workloads") or {})


def recorded_for(cfg: Mapping[str, Any], workload: str) -> Dict[str, str]:
    """Recorded digests for this workload: the file's, with the profile's ``expected`` over them."""
    path = cfg.get("digests_file") or str(_builtin_file())
    found: Dict[str, str] = {}
    if Path(path).exists() or cfg.get("digests_file"):
        found.update(load_recorded(path).get(workload) or {})
    found.update(cfg.get("expected") or {})
    return {k: str(v).lower() for k, v in found.items()}


def _builtin_file() -> Path:
    from clusterops.resources import data_dir

    return data_dir("health_profiles") / "sdc_digests.yaml"


def judge(per_dev: Dict[str, Tuple[str, str]], recorded: Mapping[str, str], workload: str) -> ProbeResult:
    """device -> (model key, digest) -> one result (pure)."""
    problems: List[str] = []
    by_key: Dict[str, Dict[str, List[str]]] = {}
    for dev, (key, dig) in per_dev.items():
        by_key.setdefault(key, {}).setdefault(dig, []).append(dev)
        want = recorded.get(key)
        if want and want != dig:
            problems.append(f"{dev} digest {dig[:12]} differs from the recorded {want[:12]} for {key}")
    for key, digs in by_key.items():
        if len(digs) > 1:
            problems.append(f"devices of {key} on this node disagree: " +
                            ", ".join(f"{'+'.join(d)}={g[:12]}" for g, d in digs.items()))
    # The node's value: the digest most of its devices gave (all of them on a healthy node).
    key, digs = next(iter(by_key.items()))
    value = max(digs.items(), key=lambda kv: len(kv[1]))[0]
    data = {"model_key": key, "workload": workload,
            "devices": {d: {"model_key": k, "digest": g} for d, (k, g) in per_dev.items()},
            "recorded": recorded.get(key)}
    if problems:
        return ProbeResult("sdc", "fail", value=value, threshold=recorded.get(key), data=data,
                           detail="; ".join(problems[:3]) + "; silent data corruption: rerun, then drain "
                                                            "and RMA the GPU if it repeats")
    how = "matches the recorded digest" if recorded.get(key) else "no recorded digest for this model"
    return ProbeResult("sdc", "pass", value=value, threshold=recorded.get(key), data=data,
                       detail=f"{len(per_dev)} device(s) of {key}: digest {value[:12]} ({how})")


def probe_sdc(cfg: Dict[str, Any], ctx: ProbeContext) -> List[ProbeResult]:
    required = bool(cfg.get("required", ctx.gpus_required))
    try:
        import torch
    except ImportError:
        return [ProbeResult("sdc", "fail" if required else "skip",
                            detail="torch not installed: pip install clusterops[torch]")]
    size = int(cfg.get("size", DEFAULTS["size"]))
    iters = int(cfg.get("iterations", DEFAULTS["iterations"]))
    seed = int(cfg.get("seed", DEFAULTS["seed"]))
    flip = parse_fault(ctx.env.get(FAULT_ENV), ctx.node)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if not cuda and required:
        return [ProbeResult("sdc", "fail", detail="no CUDA device visible to torch but the profile requires "
                                                  "GPUs: check the driver and CUDA_VISIBLE_DEVICES")]
    dtype_name = str(cfg.get("gpu_dtype", DEFAULTS["gpu_dtype"])) if cuda else "float32"
    workload = workload_id(size, iters, seed, dtype_name)
    recorded = recorded_for(cfg, workload)
    # Global torch settings, restored afterwards: the probe runs alone (exclusive), so no
    # other probe sees them. cuBLAS needs a fixed workspace to be deterministic.
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was_det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    per_dev: Dict[str, Tuple[str, str]] = {}
    try:
        if cuda:
            driver = _driver(ctx, torch)
            for i in range(torch.cuda.device_count()):
                d = digest(torch, f"cuda:{i}", size=size, iterations=iters, seed=seed,
                           dtype=getattr(torch, dtype_name), flip_bit=flip)
                per_dev[f"cuda:{i}"] = (gpu_model_key(torch, i, driver), d)
        else:
            torch.set_num_threads(1)    # one thread: the same summation order in every process
            per_dev["cpu"] = (cpu_model_key(torch), digest(torch, "cpu", size=size, iterations=iters, seed=seed,
                                                         dtype=torch.float32, flip_bit=flip))
    finally:
        torch.use_deterministic_algorithms(was_det)
        torch.set_num_threads(threads)
    res = judge(per_dev, recorded, workload)
    if flip is not None:
        res.data["fault_injected"] = f"flip:{flip}"
    return [res]


def _digests_schema():
    from clusterops import schema

    return schema.Field("sdc_digests", "map", fields=(
        schema.Field("workloads", "dict", "workload id -> model key -> hex digest",
                     item=schema.Field("workload", "dict", item=schema.Field("digest", "str"))),))


DIGESTS_FILE = _digests_schema()
