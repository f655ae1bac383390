"""The local reference runner accepts torch's teardown abort and nothing else (issue 28).

A reference run is two plain processes of a script; torch 2.13's gloo process group can
abort one rank with SIGABRT as Python shuts down, after the script finished (docs/
supervisor.md, "A rank that aborts at exit"). The stand-in script here really aborts
(os.abort), after or before its last words, so the runner reads real exit statuses.
"""

from __future__ import annotations

import sys

import pytest

from clusterops.errors import ClusteropsError
from support import faultkit as fk

SCRIPT = """\
import os, sys
rank = int(os.environ["RANK"])
mode = sys.argv[1]
print(f"rank {rank} done", flush=True)
if rank == 1 and mode in ("teardown", "early"):
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    if mode == "early":
        print("still talking", flush=True)
    os.abort()
if mode == "exit" and rank == 1:
    sys.exit(3)
if mode == "both":
    print("terminate called without an active exception", file=sys.stderr, flush=True)
    os.abort()
"""


def run(tmp_path, mode):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    return fk._run_local(2, [mode], tmp_path, sys.executable, script, 60.0, False)


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 does not end such a thread")
def test_a_rank_aborted_after_its_last_words_is_accepted(tmp_path):
    assert run(tmp_path, "teardown").strip() == "rank 0 done"


@pytest.mark.parametrize("mode", ["early", "exit", "both"])
def test_any_other_failure_fails_the_reference(tmp_path, mode):
    with pytest.raises(ClusteropsError, match="reference run failed"):
        run(tmp_path, mode)


def test_the_abort_is_recognized_narrowly():
    line = "terminate called without an active exception"
    assert fk.aborted_at_teardown(-6, f"done\n{line}\n") == (sys.version_info < (3, 14))
    assert not fk.aborted_at_teardown(-6, f"{line}\nmore\n")
    assert not fk.aborted_at_teardown(-9, f"done\n{line}\n")
    assert not fk.aborted_at_teardown(-6, "done\n")
    assert not fk.aborted_at_teardown(1, f"{line}\n")
