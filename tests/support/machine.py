"""Helpers of the state machine's unit tests: a policy without checks, and the actions of a kind."""

from __future__ import annotations

from clusterops.supervisor import CheckpointCommitted, NodesDown, Policy, Record, StepExited


def P(**kw) -> Policy:
    """A Policy with no preflight and no liveness check (the fake-clock tests drive every event)."""
    kw.setdefault("preflight", None)
    kw.setdefault("liveness_check", False)
    return Policy(**kw)


def records(actions, kind):
    """The Record actions of one timeline kind."""
    return [a for a in actions if isinstance(a, Record) and a.kind == kind]


def only(actions, kind):
    """The actions of one class."""
    return [a for a in actions if isinstance(a, kind)]


def lose(s, node, now):
    """A checkpoint at step 20, then ``node`` seen down and the step ended by its loss: the
    actions of the last two events (the relaunch, on a replacement when there is one)."""
    s.handle(CheckpointCommitted(now, 20, "/ck/20"))
    acts = s.handle(NodesDown(now + 1, {node: "DOWN"}))
    acts += s.handle(StepExited(now + 2, returncode=-9, node_failure=(node,)))
    return acts
