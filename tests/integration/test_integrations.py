"""The Lightning and Hugging Face integrations, one process, no cluster (issue 13).

Each example runs for real: the lead-time SIGUSR1 after its first committed checkpoint
becomes a checkpoint at the current step and exit 0; that checkpoint is a clusterops
commit of the framework's kind that verifies deeply; a second run resumes from it and
ends with the weights of an uninterrupted run, bitwise. `import clusterops` and the
integrations package load no framework.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops import checkpoint as ck
from clusterops.runner import Runner, kill_group, wait_exit
from support import faultkit as fk

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"lightning": REPO / "examples" / "lightning_train.py", "hf": REPO / "examples" / "hf_train.py"}
STEPS = 30


def run(script: Path, ckpt: Path, out: Path, log: Path, *, sleep: float = 0.0, stop_after_commit: bool = False):
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CLUSTEROPS_CKPT_DIR": str(ckpt)}
    unset = [k for k in os.environ if k.startswith(("SLURM_", "CLUSTEROPS_"))]
    p = Runner().spawn([sys.executable, str(script), "--steps", str(STEPS), "--ckpt-every", "10",
                        "--step-sleep", str(sleep), "--out", str(out)], log_path=str(log), env=env, unset=unset)
    try:
        if stop_after_commit:
            deadline = time.monotonic() + 120
            while not (ckpt / "step_00000010").is_dir():
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
            os.kill(p.pid, signal.SIGUSR1)
        assert wait_exit(p, 180) == 0, log.read_text()[-2000:]
    finally:
        if p.poll() is None:
            kill_group(p)
            p.wait()
    return log.read_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["lightning", "hf"])
def test_lead_signal_stops_with_a_commit_and_resume_is_exact(kind, tmp_path):
    script = EXAMPLES[kind]
    ref = tmp_path / "ref.pt"
    run(script, tmp_path / "ref-ck", ref, tmp_path / "ref.log")
    ckpt, out = tmp_path / "ck", tmp_path / "out.pt"
    text = run(script, ckpt, out, tmp_path / "a.log", sleep=0.2, stop_after_commit=True)
    m = re.search(r"^stopped step=(\d+) reason=SIGUSR1$", text, re.M)
    assert m, text[-2000:]
    step = int(m.group(1))
    assert 10 < step < STEPS and not out.exists()
    latest = ck.find_latest_good(ckpt, deep=True).latest
    assert latest is not None and latest.step == step
    assert ck.read_manifest(latest.path)["kind"] == kind
    text = run(script, ckpt, out, tmp_path / "b.log")
    assert f"resume path={latest.path}" in text and f"done step={STEPS}" in text, text[-2000:]
    assert fk.same_weights(out, ref)


def test_import_clusterops_loads_no_framework():
    code = ("import sys, clusterops, clusterops.cli, clusterops.integrations, clusterops.sdk; "
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr
