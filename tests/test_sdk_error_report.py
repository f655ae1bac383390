"""The SDK's error report (issue 28): a supervised rank that dies of an exception writes the
traceback's last line itself, so the supervisor has the program's word even when srun drops
the task's last stderr; the traceback is still printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from clusterops import protocol

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, code, hb=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTEROPS_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), RANK="3")
    if hb:
        env[protocol.ENV_HEARTBEAT_DIR] = str(tmp_path)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_an_uncaught_exception_is_reported_and_still_printed(tmp_path):
    p = _run(tmp_path, "from clusterops import sdk\nstate = {}\nstate['state']\n")
    assert p.returncode == 1 and "KeyError: 'state'" in p.stderr and "Traceback" in p.stderr
    assert protocol.read_errors(tmp_path) == {3: "KeyError: 'state'"}


def test_a_clean_exit_or_sys_exit_reports_nothing_and_unsupervised_runs_are_untouched(tmp_path):
    assert _run(tmp_path, "from clusterops import sdk\nimport sys\nsys.exit(4)\n").returncode == 4
    assert protocol.read_errors(tmp_path) == {}
    p = _run(tmp_path, "from clusterops import sdk\nimport sys\nassert sys.excepthook is sys.__excepthook__\n",
             hb=False)
    assert p.returncode == 0, p.stderr
