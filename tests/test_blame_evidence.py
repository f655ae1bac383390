"""Blame only with evidence (issue 28): the machine's verdicts on failed steps, fake clock."""

from __future__ import annotations

from clusterops import supervisor as sv
from clusterops.supervisor import (CheckpointCommitted, DrainNodes, Exit, Launch, Policy, RankFailure, Record,
                                   Requeue, StepExited, Supervisor)
from clusterops.supervisor.evidence import read_task_output

from test_evidence import TWO_RANKS


def P(**kw):
    kw.setdefault("preflight", None)
    kw.setdefault("liveness_check", False)
    return Policy(**kw)


def only(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def records(actions, kind):
    return [a for a in actions if isinstance(a, Record) and a.kind == kind]


def exited(now, failures, text, ckpt=None, rc=1):
    """A step end as the plumbing builds it: srun's failure lines and the ranks' own output."""
    said = read_task_output(text)
    return StepExited(now, returncode=rc, failures=tuple(RankFailure(*f) for f in failures), ckpt_step=ckpt,
                      task_output={t: o for t, o in said.items() if t in {f[1] for f in failures}})


def tb(rank, error):
    return f'{rank}: Traceback (most recent call last):\n{rank}:   File "train.py", line 3, in <module>\n{rank}: {error}\n'


def test_issue_case_traceback_on_rank0_of_2_srun_terminates_rank1_blames_nobody():
    s = Supervisor(P(nodes=2, drain_bad_nodes=False), ["node1", "node2"])
    acts = s.start(1000.0)
    fails = [("node1", 0, "Exited with exit code 1"), ("node2", 1, "Terminated")]
    for i in range(10):
        acts = s.handle(exited(1010.0 + i, fails, TWO_RANKS))
        e = records(acts, "step_exit")[0].data
        assert e["cause"] == "program_error" and e["blamed"] == [] and e["error"] == "KeyError: 'state'"
        assert not records(acts, "node_bad") and not only(acts, Requeue) and not only(acts, DrainNodes)
        if only(acts, Exit):
            break
        assert only(acts, Launch)[0].nodes == ("node1", "node2")
    ex = only(acts, Exit)[0]
    assert ex.code == sv.EXIT_NO_PROGRESS and ex.error == "KeyError: 'state'" and "KeyError: 'state'" in ex.reason
    assert records(acts, "give_up")[0].data["error"] == "KeyError: 'state'"
    assert s.memory.bad_nodes == {}


def test_traceback_on_one_rank_of_four_blames_nobody():
    s = Supervisor(P(nodes=4, node_fail_threshold=1), ["n1", "n2", "n3", "n4"])
    s.start(1000.0)
    fails = [("n3", 2, "Exited with exit code 1"), ("n1", 0, "Terminated"), ("n2", 1, "Killed"),
             ("n4", 3, "Terminated")]
    acts = s.handle(exited(1010.0, fails, "0: step 1\n" + tb(2, "ValueError: bad shard 7")))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "program_error" and e["blamed"] == [] and e["error"] == "ValueError: bad shard 7"
    assert not records(acts, "node_bad") and only(acts, Launch)[0].nodes == ("n1", "n2", "n3", "n4")


def test_bare_exit_code_without_text_blames_nobody_either():
    s = Supervisor(P(nodes=2, node_fail_threshold=1), ["a", "b"])
    s.start(1000.0)
    acts = s.handle(exited(1010.0, [("b", 1, "Exited with exit code 3"), ("a", 0, "Terminated")], ""))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "rank_exit" and e["blamed"] == [] and not records(acts, "node_bad")


def test_error_on_one_node_only_is_tried_without_it_then_blamed_when_the_run_gets_past():
    # node n2's environment makes rank 1 raise: twice the same rank, same node, same error
    # (cannot tell rank from node), then a relaunch on the spare gets past the step: n2's.
    s = Supervisor(P(nodes=3, spare_nodes=1, drain_bad_nodes=True), ["n1", "n2", "n3", "n4"])
    s.start(1000.0)
    fails = [("n2", 1, "Exited with exit code 1"), ("n1", 0, "Terminated"), ("n3", 2, "Terminated")]
    err = "RuntimeError: CLUSTEROPS_SCRATCH=/bad is not writable"
    acts = s.handle(exited(1010.0, fails, tb(1, err), ckpt=10))
    assert records(acts, "step_exit")[0].data["cause"] == "program_error"
    assert not records(acts, "node_suspect") and only(acts, Launch)[0].nodes == ("n1", "n2", "n3")
    acts = s.handle(exited(1020.0, fails, tb(1, err), ckpt=10))
    assert records(acts, "step_exit")[0].data["blamed"] == [] and not records(acts, "node_bad")
    trial = records(acts, "node_suspect")[0].data
    assert trial["node"] == "n2" and trial["decision"] == "trial" and trial["rank"] == 1
    assert only(acts, Launch)[0].nodes == ("n1", "n3", "n4")            # without n2, not drained
    assert not only(acts, DrainNodes)
    acts = s.handle(CheckpointCommitted(1030.0, 10, "/ck/step_10"))      # not past the failure point
    assert not records(acts, "node_bad")
    acts = s.handle(CheckpointCommitted(1040.0, 20, "/ck/step_20"))      # past it, without n2
    assert records(acts, "node_suspect")[0].data["decision"] == "blamed"
    assert records(acts, "node_bad")[0].data["node"] == "n2"
    assert only(acts, DrainNodes)[0].nodes == ("n2",) and "n2" in s.memory.bad_nodes


def test_a_peers_own_traceback_about_the_failed_rank_does_not_clear_the_suspect():
    # As on the dev cluster: rank 1 raises on n2 only, rank 0 then prints its own gloo error
    # (a consequence, another line), and is terminated or exits 1 itself.
    s = Supervisor(P(nodes=2, spare_nodes=1, drain_bad_nodes=False), ["n1", "n2", "n3"])
    s.start(1000.0)
    err = "RuntimeError: scratch on n2 is not writable"
    text = tb(1, err) + tb(0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:19342")
    acts = s.handle(exited(1010.0, [("n2", 1, "Exited with exit code 1"), ("n1", 0, "Terminated")], text, ckpt=10))
    assert records(acts, "step_exit")[0].data["error"] == err and not records(acts, "node_suspect")
    acts = s.handle(exited(1020.0, [("n2", 1, "Exited with exit code 1"), ("n1", 0, "Exited with exit code 1")],
                           text, ckpt=10))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "program_error" and e["blamed"] == [] and e["error"] == err
    assert records(acts, "node_suspect")[0].data["decision"] == "trial"
    assert only(acts, Launch)[0].nodes == ("n1", "n3")


def test_error_on_one_node_that_follows_the_rank_elsewhere_is_the_programs():
    s = Supervisor(P(nodes=3, spare_nodes=1, drain_bad_nodes=True), ["n1", "n2", "n3", "n4"])
    s.start(1000.0)
    err = "KeyError: 'state'"
    for i in range(2):
        acts = s.handle(exited(1010.0 + i, [("n2", 1, "Exited with exit code 1"), ("n1", 0, "Terminated")],
                               tb(1, err), ckpt=10))
    assert only(acts, Launch)[0].nodes == ("n1", "n3", "n4")
    # Rank 1 now runs on n3 and raises the same: the program's, nobody blamed, n2 back as a spare.
    acts = s.handle(exited(1030.0, [("n3", 1, "Exited with exit code 1"), ("n1", 0, "Terminated")],
                           tb(1, err), ckpt=10))
    assert records(acts, "node_suspect")[0].data["decision"] == "cleared"
    assert not records(acts, "node_bad") and s.memory.bad_nodes == {}
    assert "n2" in s.spares or only(acts, Exit)


def test_without_a_spare_the_repeated_error_ends_by_the_no_progress_rule_blaming_nobody():
    s = Supervisor(P(nodes=2, no_progress_restarts=1), ["a", "b"])
    s.start(1000.0)
    for i in range(2):
        acts = s.handle(exited(1010.0 + i, [("b", 1, "Exited with exit code 1"), ("a", 0, "Terminated")],
                               tb(1, "OSError: [Errno 5] Input/output error")))
    assert only(acts, Exit)[0].code == sv.EXIT_NO_PROGRESS and not records(acts, "node_bad")


def test_hardware_evidence_is_still_blamed():
    s = Supervisor(P(nodes=2, spare_nodes=1, node_fail_threshold=1), ["a", "b", "c"])
    s.start(1000.0)
    # A SIGKILLed rank: blamed (srun's "Terminated" of the other one is not).
    acts = s.handle(exited(1010.0, [("b", 1, "Killed"), ("a", 0, "Terminated")], "", rc=137))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "rank_killed" and e["blamed"] == ["b"] and e["evidence"] == "signal"
    assert only(acts, Launch)[0].nodes == ("a", "c")


def test_nccl_error_text_of_the_failed_rank_blames_its_node_unless_every_node_says_it():
    text = tb(1, "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
                 "system error")
    s = Supervisor(P(nodes=2, spare_nodes=1, node_fail_threshold=1), ["a", "b", "c"])
    s.start(1000.0)
    acts = s.handle(exited(1010.0, [("b", 1, "Exited with exit code 1"), ("a", 0, "Terminated")], text))
    e = records(acts, "step_exit")[0].data
    assert e["blamed"] == ["b"] and e["evidence"] == "hardware" and e["sign"][0] == "nccl_error"
    assert records(acts, "node_bad")[0].data["node"] == "b"
    # The same NCCL error from both nodes: the run's setting, nobody blamed.
    s = Supervisor(P(nodes=2, node_fail_threshold=1), ["a", "b"])
    s.start(1000.0)
    both = text + text.replace("1:", "0:")
    acts = s.handle(exited(1010.0, [("b", 1, "Exited with exit code 1"), ("a", 0, "Exited with exit code 1")], both))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "program_error" and e["blamed"] == []


def test_lost_node_still_blamed():
    s = Supervisor(P(nodes=2, spare_nodes=1), ["a", "b", "c"])
    s.start(1000.0)
    acts = s.handle(StepExited(1010.0, returncode=1, node_failure=("b",),
                               failures=(RankFailure("b", 1, "Exited with exit code 1"),)))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "node_lost" and e["blamed"] == ["b"] and e["evidence"] == "node_lost"
    assert records(acts, "node_bad")[0].data["node"] == "b"


def test_a_rank_that_aborted_itself_blames_nobody():
    """SIGABRT is raised by the process (here torch's gloo teardown race, recorded on the dev
    cluster: test_evidence.TEARDOWN_ABORT): a program error, not its node's."""
    from test_evidence import TEARDOWN_ABORT

    s = Supervisor(P(nodes=2, spare_nodes=1, node_fail_threshold=1), ["node1", "node2", "node3"])
    s.start(1000.0)
    fails = [("node1", 1, "Aborted (core dumped)"), ("node1", 0, "Terminated"), ("node2", 2, "Terminated"),
             ("node2", 3, "Terminated")]
    acts = s.handle(exited(1010.0, fails, TEARDOWN_ABORT, rc=143))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "program_error" and e["blamed"] == []
    assert e["error"] == "terminate called without an active exception"
    assert not records(acts, "node_bad") and only(acts, Launch)[0].nodes == ("node1", "node2")
    # Aborted with nothing said: no evidence either way.
    s = Supervisor(P(nodes=2, node_fail_threshold=1), ["a", "b"])
    s.start(1000.0)
    acts = s.handle(exited(1010.0, [("b", 1, "Aborted"), ("a", 0, "Terminated")], "", rc=134))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "rank_failed" and e["blamed"] == [] and not records(acts, "node_bad")


def test_an_abort_with_a_hardware_sign_of_its_own_node_is_still_blamed():
    text = ("1: terminate called after throwing an instance of 'c10::DistBackendError'\n"
            "1:   what():  NCCL error in: ProcessGroupNCCL.cpp:2034, unhandled system error\n")
    s = Supervisor(P(nodes=2, spare_nodes=1, node_fail_threshold=1), ["a", "b", "c"])
    s.start(1000.0)
    acts = s.handle(exited(1010.0, [("b", 1, "Aborted (core dumped)"), ("a", 0, "Terminated")], text, rc=134))
    e = records(acts, "step_exit")[0].data
    assert e["blamed"] == ["b"] and e["evidence"] == "hardware" and e["sign"][0] == "nccl_error"
