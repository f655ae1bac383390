"""``support.users.traversable``: the o+x the user tests open on the interpreter's path is
shared by every test process of the machine (issue 28).

The suite runs in several pytest-xdist workers at once, and a second session may run
beside it. Each of them opens the same host directories (here /root, 0700) for the
length of its user tests. The last one to leave restores the modes, never an earlier
one while another still needs them, and a holder killed on the way out (SIGKILL, a
pytest timeout) does not keep them open for good. The holders here are real processes
and the directory a real 0700 one under /tmp (not pytest's tmp_path: its parents are
themselves 0700 and shared by the workers).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support import users

TESTS = Path(__file__).resolve().parent

HOLDER = """
import sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from support import users
with users.traversable([Path(sys.argv[1])], registry=Path(sys.argv[2])):
    print("in", flush=True)
    sys.stdin.read()
print("out", flush=True)
"""


@pytest.fixture
def home():
    """A private directory (0700) with an interpreter-like path under it; the registry of
    holders beside it, so this test shares nothing with the real one under /run."""
    base = Path(tempfile.mkdtemp(prefix="clusterops-traverse-"))
    base.chmod(0o755)
    h = base / "home"
    (h / "py" / "bin").mkdir(parents=True)
    h.chmod(0o700)
    yield h, h / "py" / "bin", base / "registry"
    shutil.rmtree(base, ignore_errors=True)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _holder(target: Path, registry: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(target), str(registry), str(TESTS)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "in"
    return p


def test_an_earlier_holder_leaving_keeps_the_path_open_for_a_later_one(home):
    h, target, registry = home
    first = _holder(target, registry)          # another worker opened /root first
    try:
        assert _mode(h) == 0o701
        with users.traversable([target], registry=registry):
            first.stdin.close()                # ... and leaves while this one still runs
            assert first.stdout.readline().strip() == "out" and first.wait(30) == 0
            assert _mode(h) == 0o701, "a holder that left closed the path under a live one"
        assert _mode(h) == 0o700               # the last to leave restores
    finally:
        first.kill()
        first.wait()


def test_a_holder_killed_inside_does_not_keep_the_path_open(home):
    h, target, registry = home
    dead = _holder(target, registry)
    dead.send_signal(signal.SIGKILL)           # no finally block runs
    dead.wait()
    assert _mode(h) == 0o701
    with users.traversable([target], registry=registry) as opened:
        assert h in opened and _mode(h) == 0o701
    assert _mode(h) == 0o700


def test_nested_holders_in_one_process_and_a_path_that_needs_nothing(home, tmp_path):
    h, target, registry = home
    with users.traversable([target], registry=registry):
        with users.traversable([target], registry=registry):
            pass
        assert _mode(h) == 0o701
    assert _mode(h) == 0o700
    with users.traversable([Path("/usr/bin")], registry=registry) as opened:
        assert opened == []
