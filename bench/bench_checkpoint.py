#!/usr/bin/env python3
"""Checkpoint benchmarks: commit overhead, async blocking time, latest-good lookup.

    .venv/bin/python bench/bench_checkpoint.py [--dir /tmp] [--size-mb 1024] [--runs 5]

1. Commit overhead: clusterops.sdk.save() (temp dir, hash while writing, fsync of
   files and directories, manifest, rename) against a plain torch.save of the same
   state to the same disk, in this script; median of --runs each, runs interleaved,
   page cache flushed (sync) before each timed call so no run pays for another's
   writeback. Target: ratio <= 1.10. Also shown: torch.save + fsync (the cost of
   durability alone) and the sha256 hash variant (default is crc32).
2. Async save: how long the training loop is blocked by save(async_=True) (the
   snapshot copy) against the synchronous save.
3. Latest-good lookup over 10,000 committed checkpoint directories (manifest and
   sizes checked): target < 200 ms. Also the case where the 100 newest are broken.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterops import checkpoint as ck  # noqa: E402
from clusterops import sdk  # noqa: E402


def make_state(size_mb: int):
    import torch

    n_tensors = 16
    per = size_mb * (1 << 20) // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(per, generator=g) for i in range(n_tensors)}


def flush_cache() -> None:
    os.sync()


def timed(fn) -> float:
    flush_cache()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_commit(base: Path, state, runs: int) -> dict:
    import torch

    results = {"torch.save": [], "torch.save+fsync": [], "torch.save no-rec-crc": [], "sdk.save sha256": [],
               "sdk.save crc32": []}
    root = base / "ck"
    plain = base / "plain.pt"

    def plain_save():
        torch.save(state, plain)

    def plain_fsync():
        torch.save(state, plain)
        fd = os.open(plain, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def plain_nocrc():
        # torch.save with its per-record CRC32 off, as sdk.save runs it: shows how much
        # of the difference is torch's own CRC pass rather than clusterops' I/O path.
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(state, plain)
        finally:
            torch.serialization.set_crc32_options(True)

    step = [0]

    def sdk_save(algo):
        step[0] += 1
        sdk.save(state, step[0], root=root, algo=algo)

    for r in range(runs):
        for name, fn in (("torch.save", plain_save), ("sdk.save sha256", lambda: sdk_save("sha256")),
                         ("torch.save+fsync", plain_fsync), ("sdk.save crc32", lambda: sdk_save("crc32")),
                         ("torch.save no-rec-crc", plain_nocrc)):
            results[name].append(timed(fn))
            # clean up outside the timing
            if plain.exists():
                plain.unlink()
            shutil.rmtree(root, ignore_errors=True)
        print(f"  run {r + 1}/{runs}: " + "  ".join(f"{k}={v[-1]:.2f}s" for k, v in results.items()), flush=True)
    return {k: statistics.median(v) for k, v in results.items()}, {k: min(v) for k, v in results.items()}


def bench_async(base: Path, state, runs: int) -> dict:
    root = base / "ck_async"
    sync_s, blocked_s, total_s = [], [], []
    for r in range(runs):
        sync_s.append(timed(lambda: sdk.save(state, 2 * r + 1, root=root)))
        flush_cache()
        t0 = time.perf_counter()
        sdk.save(state, 2 * r + 2, root=root, async_=True)
        blocked_s.append(time.perf_counter() - t0)
        sdk.wait()
        total_s.append(time.perf_counter() - t0)
        shutil.rmtree(root, ignore_errors=True)
    return {"sync_s": statistics.median(sync_s), "async_blocked_s": statistics.median(blocked_s),
            "async_total_s": statistics.median(total_s)}


def make_many(root: Path, count: int) -> None:
    """count committed checkpoints, written directly (valid manifests, no fsync, for speed)."""
    payload = b"x" * 256
    digest = hashlib.sha256(payload).hexdigest()
    root.mkdir(parents=True)
    for s in range(1, count + 1):
        d = root / ck.step_dir_name(s)
        d.mkdir()
        (d / "state.pt").write_bytes(payload)
        (d / "rank_0.pt").write_bytes(payload)
        m = {"format": ck.FORMAT, "version": ck.FORMAT_VERSION, "step": s, "time": time.time(),
             "world_size": 1, "kind": "torch", "hash_algo": "sha256", "meta": {},
             "files": {"state.pt": {"size": len(payload), "hash": digest},
                       "rank_0.pt": {"size": len(payload), "hash": digest}}}
        (d / ck.MANIFEST_NAME).write_text(json.dumps(m))


def bench_lookup(base: Path, count: int, reps: int = 11) -> dict:
    root = base / "many"
    make_many(root, count)
    os.sync()

    def med(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    out = {"latest_good_ms": 1000 * med(lambda: ck.find_latest_good(root))}
    assert ck.latest_good(root) == root / ck.step_dir_name(count)
    for s in range(count - 99, count + 1):
        os.truncate(root / ck.step_dir_name(s) / "state.pt", 1)
    out["latest_good_100_broken_ms"] = 1000 * med(lambda: ck.find_latest_good(root))
    assert ck.latest_good(root) == root / ck.step_dir_name(count - 100)
    out["list_all_ms"] = 1000 * statistics.median([_t(lambda: ck.list_checkpoints(root)) for _ in range(3)])
    return out


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where to write (a real disk)")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=10_000, help="checkpoint dirs for the lookup benchmark")
    ap.add_argument("--skip-commit", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        print(f"lookup over {args.count} committed checkpoints under {base}:", flush=True)
        lk = bench_lookup(base, args.count)
        print(f"  latest-good (shallow)          {lk['latest_good_ms']:8.1f} ms   target < 200 ms")
        print(f"  latest-good, 100 newest broken {lk['latest_good_100_broken_ms']:8.1f} ms")
        print(f"  list + verify all              {lk['list_all_ms']:8.1f} ms")
        shutil.rmtree(base / "many")
        if args.skip_commit:
            return 0
        state = make_state(args.size_mb)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        print(f"\ncommit overhead, state {nbytes / 2**30:.2f} GiB, {args.runs} runs (median):", flush=True)
        c, cmin = bench_commit(base, state, args.runs)
        ref = c["torch.save"]
        print(f"  {'':18s} {'median':>9s} {'ratio':>7s} {'GB/s':>7s}   {'best':>7s} {'ratio':>6s}")
        for k, v in c.items():
            print(f"  {k:18s} {v:7.2f} s {v / ref:6.2f}x {nbytes / v / 1e9:7.2f}   {cmin[k]:5.2f} s "
                  f"{cmin[k] / cmin['torch.save']:5.2f}x")
        print(f"  ratio sdk.save (default crc32) / torch.save = {c['sdk.save crc32'] / ref:.2f}x (target <= 1.10x)")
        print(f"  ratio sdk.save (default crc32) / (torch.save+fsync) = "
              f"{c['sdk.save crc32'] / c['torch.save+fsync']:.2f}x")
        print(f"  ratio sdk.save (sha256) / torch.save = {c['sdk.save sha256'] / ref:.2f}x")
        print("\nasync save (median):", flush=True)
        a = bench_async(base, state, max(3, args.runs // 2))
        print(f"  synchronous save        {a['sync_s']:7.2f} s")
        print(f"  async: loop blocked     {a['async_blocked_s']:7.2f} s   "
              f"({a['async_blocked_s'] / a['sync_s']:.2f}x of the synchronous save)")
        print(f"  async: until committed  {a['async_total_s']:7.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
