"""Where the test suite's CPU goes: every process's CPU time, summed by what it runs.

Run beside the suite (it only reads /proc):
    .venv/bin/python bench/bench_suite_cpu.py --out /tmp/suite-cpu.json &   # then: bash scripts/test.sh
    .venv/bin/python bench/bench_suite_cpu.py --report /tmp/suite-cpu.json
    .venv/bin/python bench/bench_suite_cpu.py --imports      # a rank's import cost, median of 5

Every half second it reads each process's user+system CPU (``/proc/<pid>/stat``) and keeps
the last figure per process (pid and start time: pids are reused), labelled by its command:
the script a Python process runs (``script train.py``), its ``-m`` module, or the program's
name. A process that lives under half a second is missed; the suite's training ranks live
for seconds. The report gives each label's processes and CPU-seconds, and the share of the
training scripts (``examples/*.py`` and the tests' own DDP scripts). ``--imports`` times, in
fresh interpreters, what a rank of ``examples/train.py`` imports before its first step, with
a bare interpreter's start as the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def label(argv) -> str:
    prog = os.path.basename(argv[0])
    if not prog.startswith("python"):
        return prog[:40]
    rest = argv[1:]
    for i, arg in enumerate(rest):
        if arg == "-m" and i + 1 < len(rest):
            return "-m " + rest[i + 1]
        if arg == "-c":
            return "-c"
        if arg.endswith(".py"):
            return "script " + os.path.basename(arg)
        if not arg.startswith("-"):
            return "bin " + os.path.basename(arg)
    return "python"


def sample(out: str, interval_s: float) -> None:
    seen = {}
    last_dump = 0.0
    while True:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                key = f"{entry}:{fields[19]}"
                ticks = int(fields[11]) + int(fields[12])
                if key not in seen:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
                    if not argv:
                        continue
                    seen[key] = [label(argv), ticks]
                seen[key][1] = ticks
            except (OSError, IndexError, ValueError):
                continue
        if time.monotonic() - last_dump > 10:
            totals = {}
            for name, ticks in seen.values():
                n, cpu = totals.get(name, (0, 0.0))
                totals[name] = (n + 1, cpu + ticks / TICK)
            with open(out + ".tmp", "w") as f:
                json.dump(totals, f)
            os.replace(out + ".tmp", out)
            last_dump = time.monotonic()
        time.sleep(interval_s)


def report(path: str, top: int) -> None:
    with open(path) as f:
        totals = json.load(f)
    whole = sum(cpu for _, cpu in totals.values())
    print(f"{'what':44s} {'processes':>9s} {'CPU-s':>9s} {'share':>6s}")
    for name, (n, cpu) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name[:44]:44s} {n:9d} {cpu:9.1f} {cpu / whole:6.1%}")
    scripts = [(n, cpu) for name, (n, cpu) in totals.items()
               if name.startswith("script ") and name != "script " + os.path.basename(__file__)]
    n, cpu = sum(s[0] for s in scripts), sum(s[1] for s in scripts)
    print(f"\nall: {whole:.0f} CPU-s; training scripts: {n} processes, {cpu:.0f} CPU-s ({cpu / whole:.0%}), "
          f"{cpu / max(n, 1):.2f} CPU-s each")


IMPORT_STEPS = [
    ("interpreter", "pass"),
    ("import torch", "import torch"),
    ("+ torch.distributed.checkpoint", "import torch, torch.distributed.checkpoint"),
    ("+ torch._dynamo (an optimizer's first method call)",
     "import torch, torch.distributed.checkpoint, torch._dynamo"),
    ("+ clusterops.sdk", "import torch, torch.distributed.checkpoint, torch._dynamo, clusterops.sdk"),
]


def imports(runs: int) -> None:
    code = ("import resource, time\nt = time.process_time()\n{body}\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\nprint(r.ru_utime + r.ru_stime)")
    prev = None
    for name, body in IMPORT_STEPS:
        cpu = statistics.median(float(subprocess.run([sys.executable, "-c", code.format(body=body)], check=True,
                                                     capture_output=True, text=True).stdout)
                                for _ in range(runs))
        extra = "" if prev is None else f"  (+{cpu - prev:.2f})"
        print(f"{name:52s} {cpu:6.2f} CPU-s{extra}")
        prev = cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="sample until killed, writing the totals here every 10 s")
    p.add_argument("--report", help="print the totals a sampler wrote")
    p.add_argument("--imports", action="store_true", help="a rank's import cost")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    if a.out:
        sample(a.out, a.interval)
    elif a.report:
        report(a.report, a.top)
    elif a.imports:
        imports(a.runs)
    else:
        p.error("one of --out, --report, --imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
