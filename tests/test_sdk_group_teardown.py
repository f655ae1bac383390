"""The SDK's process group is really freed when it is left (torch 2.13's held default group).

torch.distributed.nn.functional binds ``group=group.WORLD`` into its functions' defaults
when first imported; the first optimizer a script builds imports it (through
torch._dynamo). After init_process_group() that holds the default group for the rest of
the process: destroy_process_group() leaves its gloo worker threads running into the
interpreter's shutdown, where one can abort the process (docs/supervisor.md, "A rank that
aborts at exit"). Two real gloo ranks on 127.0.0.1, in the order most scripts use: the
SDK's group first, then the optimizer.
"""

from __future__ import annotations

import json
import sys

from support import faultkit as fk

SCRIPT = """
import gc, json, os
import torch
from clusterops import sdk
sdk.init_distributed(install_signal_handlers=False)
opt = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)   # imports torch._dynamo
import torch.distributed.nn.functional as F
held = [type(d).__name__ for d in F.all_reduce.__defaults__ if d is not None and "Group" in type(d).__name__]
torch.distributed.barrier()
sdk.shutdown()
gc.collect()
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(json.dumps({"held": held, "threads": threads}), flush=True)
"""


def test_the_sdk_group_is_freed_after_the_script_builds_its_optimizer(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(SCRIPT)
    fk._run_local(2, [], tmp_path, sys.executable, script, 120.0, False)    # raises unless both exit 0
    for r in range(2):
        out = (tmp_path / f"rank{r}.log").read_text()
        rec = json.loads(next(line for line in out.splitlines() if line.startswith('{"held"')))
        assert rec["held"] == [], rec                       # the defaults do not hold the group
        assert not any(t.startswith(("pt_gloo", "gloo_")) for t in rec["threads"]), rec
