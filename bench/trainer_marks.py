#!/usr/bin/env python3
"""Run a trainer example and print when each phase began (for bench/bench_trainers.py --phases).

    BENCH_TRAINER=lightning|hf python bench/trainer_marks.py EXAMPLE-ARGS...

Prints ``bench-mark NAME UNIX_TIME`` lines: start (the process runs), train_begin (the
integration's first hook: imports, model and Trainer built), train_end (its last
hook), exit (the interpreter is leaving). The example itself runs unchanged, in this
process, with the integration's hooks wrapped to print the marks.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path


def mark(name: str) -> None:
    print(f"bench-mark {name} {time.time():.3f}", flush=True)


mark("start")
atexit.register(mark, "exit")
REPO = Path(__file__).resolve().parent.parent


def wrap(cls, begin: str, end: str) -> None:
    ob, oe = getattr(cls, begin), getattr(cls, end)

    def on_begin(self, *a, **k):
        mark("train_begin")
        return ob(self, *a, **k)

    def on_end(self, *a, **k):
        mark("train_end")
        return oe(self, *a, **k)

    setattr(cls, begin, on_begin)
    setattr(cls, end, on_end)


def main() -> int:
    kind, args = os.environ.get("BENCH_TRAINER", ""), sys.argv[1:]
    sys.path.insert(0, str(REPO / "examples"))
    if kind == "hf":
        import hf_train as example
        from clusterops.integrations.transformers import ClusteropsTrainerCallback

        wrap(ClusteropsTrainerCallback, "on_train_begin", "on_train_end")
    elif kind == "lightning":
        import lightning_train as example
        from clusterops.integrations.lightning import ClusteropsCallback

        wrap(ClusteropsCallback, "on_train_start", "on_train_end")
    else:
        print(f"trainer_marks.py: BENCH_TRAINER={kind!r}: must be lightning or hf", file=sys.stderr)
        return 2
    return example.main(args)


if __name__ == "__main__":
    sys.exit(main())
