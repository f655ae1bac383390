"""The supervisor's per-node torchrun command, run for real on this machine (issue 13)."""

from __future__ import annotations

import sys

from clusterops.runner import Runner, free_port
from clusterops.supervisor.run import torchrun_command

PROBE = """
import os, signal
fields = [os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
          signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN,
          *os.sys.argv[1:]]
# One write of the whole line: the two workers share the pipe, and an unbuffered print()
# writes each field apart, so their lines could interleave.
os.write(1, (" ".join(map(str, fields)) + "\\n").encode())
"""


def test_one_agent_starts_its_workers_with_the_step_rank_and_ignored_stop_signals(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    argv = torchrun_command([sys.executable, str(script), "--x", "a b"], sys.executable, 1, 2)
    assert argv[:2] == ["bash", "-c"] and "--max-restarts=0" in argv[2]
    env = {"SLURM_PROCID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
           "OMP_NUM_THREADS": "1"}
    p = Runner().run(argv, env=env, timeout_s=120, check=False, unset=["RANK", "WORLD_SIZE", "LOCAL_RANK"])
    assert p.returncode == 0, p.stderr[-1500:]
    lines = sorted(p.stdout.split("\n")[:-1])
    # Workers inherit USR1/USR2 ignored from the agent; the SDK's handlers replace that.
    assert lines == ["0 2 0 True True --x a b", "1 2 1 True True --x a b"], p.stdout


def test_a_program_that_is_not_python_runs_with_no_python():
    argv = torchrun_command(["/bin/prog", "--flag"], sys.executable, 3, 4)
    assert argv[3:] == [sys.executable, "3", "4", "0", "--no-python", "/bin/prog", "--flag"]   # rotate 0
