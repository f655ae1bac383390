"""Exit codes as a contract (issue 30, part 2): the spec's table, the defaults, and what the
machine does with each action (fake clock)."""

from __future__ import annotations

import pytest

from support.machine import P, only, records
from clusterops import supervisor as sv
from clusterops.errors import InputError
from clusterops.launch.spec import load_spec
from clusterops.supervisor import (DrainNodes, Exit, Launch, RankFailure, Requeue, ResumeChosen,
                                   StepExited, Supervisor)
from clusterops.supervisor.config import exit_codes


def test_defaults_and_the_spec_merges_over_them():
    assert exit_codes({}) == {16: "relaunch_without_suspects", 17: "stop", 93: "stop"}
    assert exit_codes({"exit_codes": {42: "requeue", "17": "relaunch"}}) == {
        16: "relaunch_without_suspects", 17: "relaunch", 42: "requeue", 93: "stop"}


@pytest.mark.parametrize("value,msg", [
    ({42: "reboot"}, "spec: supervise.exit_codes.42: unknown action 'reboot'"),
    ({0: "stop"}, "spec: supervise.exit_codes.0: exit codes are whole numbers from 1 to 255"),
    ({"x": "stop"}, "exit codes are whole numbers from 1 to 255, got 'x'"),
    ([16], "must be a mapping of exit code -> action"),
])
def test_bad_tables_are_one_line_errors_naming_the_key(value, msg):
    with pytest.raises(InputError) as e:
        exit_codes({"exit_codes": value})
    assert msg in e.value.message and "\n" not in e.value.message


def test_the_job_spec_names_the_file_line_and_key(tmp_path):
    (tmp_path / "t.py").write_text("")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: j\nnodes: 2\nlauncher: srun\nscript: t.py\nsupervise:\n  exit_codes:\n    16: relaunch\n"
                    "    42: reboot\n")
    with pytest.raises(InputError) as e:
        load_spec(spec)
    assert f"{spec}:8: supervise.exit_codes.42: unknown action 'reboot'" in e.value.message, e.value.message


def _sup(**kw):
    codes = kw.pop("codes", None)
    s = Supervisor(P(**kw), ["a", "b", "c"], exit_codes=codes)
    s.start(1000.0)
    s.handle(ResumeChosen(1000.0, 10, "/ck/step_10", ()))
    return s


def _exit(code, **kw):
    return StepExited(1010.0, returncode=code, failures=(RankFailure("b", 1, f"Exited with exit code {code}"),
                                                         RankFailure("a", 0, "Terminated")), **kw)


def test_stop_ends_the_job_with_its_own_exit_code():
    for code in (17, 93):
        s = _sup(nodes=2, spare_nodes=1)
        acts = s.handle(_exit(code))
        assert records(acts, "exit_contract")[0].data == {"code": code, "action": "stop"}
        assert only(acts, Exit)[0].code == sv.EXIT_SCRIPT_STOP == 10 and not only(acts, Launch)


def test_relaunch_without_suspects_leaves_the_named_nodes_out_and_drains_them_when_allowed():
    s = _sup(nodes=2, spare_nodes=1, drain_bad_nodes=True)
    acts = s.handle(_exit(16, suspect_ranks=(1,)))
    assert records(acts, "exit_contract")[0].data["suspects"] == ["b"]
    assert records(acts, "step_exit")[0].data["exit_code"] == 16
    assert only(acts, DrainNodes)[0].nodes == ("b",) and only(acts, Launch)[0].nodes == ("a", "c")
    s = _sup(nodes=2, spare_nodes=1)
    acts = s.handle(_exit(16, suspect_nodes=("c", "zz")))      # a name outside the allocation is ignored
    assert records(acts, "exit_contract")[0].data["suspects"] == ["c"] and not only(acts, DrainNodes)
    assert only(acts, Launch)[0].nodes == ("a", "b")


def test_relaunch_without_a_named_suspect_says_so_and_relaunches():
    s = _sup(nodes=2, spare_nodes=1)
    acts = s.handle(_exit(16))
    assert "named no suspect" in records(acts, "exit_contract")[0].data["note"]
    assert only(acts, Launch)[0].nodes == ("a", "b") and not records(acts, "node_bad")


def test_requeue_and_plain_relaunch_and_unmapped_codes():
    s = _sup(nodes=2, codes={42: "requeue", 43: "relaunch"})
    assert only(s.handle(_exit(42)), Requeue)
    s = _sup(nodes=2, codes={43: "relaunch"})
    acts = s.handle(_exit(43))
    assert only(acts, Launch) and not records(acts, "node_bad")
    s = _sup(nodes=2, codes={})
    acts = s.handle(_exit(17))                                   # unmapped: the ordinary rules
    assert not records(acts, "exit_contract") and only(acts, Launch)


def test_a_signal_is_no_exit_code_word():
    s = _sup(nodes=2)
    acts = s.handle(StepExited(1010.0, returncode=137, failures=(RankFailure("b", 1, "Killed"),)))
    assert not records(acts, "exit_contract")


def test_suspect_reports_are_merged_and_junk_is_left_out(tmp_path):
    from clusterops import protocol

    protocol.write_suspects(tmp_path, 1, ["node2"], [1], "rerun differs")
    protocol.write_suspects(tmp_path, 3, ["node2", "bad name;rm"], [3, -1], "")
    (tmp_path / protocol.SUSPECTS_DIR / "rank5.json").write_text("{torn")
    got = protocol.read_suspects(tmp_path)
    assert got == {"nodes": ["node2"], "ranks": [1, 3], "why": ["rerun differs"]}
