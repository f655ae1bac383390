"""Helpers of the state machine's unit tests: a policy without checks, and the actions of a kind."""

from __future__ import annotations

from clusterops.supervisor import Policy, Record


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
