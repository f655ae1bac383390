"""A stop signal that lands while a process exits cleanly must not kill it (issue 28)."""
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The SDK's stop handlers in, then a clean exit whose interpreter shutdown is slow (as a
# torch process's is): an object freed with the module table sleeps there, after Python has
# put its own handlers back to the default.
SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from clusterops import sdk
assert sdk.install_stop_handlers()
class SlowTeardown:
    def __del__(self):
        time.sleep(1.5)
mod = type(sys)("slow_teardown")
mod.obj = SlowTeardown()
sys.modules["slow_teardown"] = mod
print("exiting", flush=True)
"""


def test_usr2_during_interpreter_shutdown_leaves_exit_code_zero(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(REPO)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "exiting"
    time.sleep(0.6)                      # main is done; the shutdown sleeps in __del__
    p.send_signal(signal.SIGUSR2)        # the supervisor's stop to the step, arriving late
    p.send_signal(signal.SIGUSR1)        # and a launcher's lead-time signal
    assert p.wait(timeout=30) == 0
