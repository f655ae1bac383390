"""One polling helper for tests that wait on a real cluster or real processes:
``wait_for(predicate, timeout_s, what)`` instead of fixed sleeps."""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold in time (an AssertionError, so pytest shows it as a failure)."""


def wait_for(predicate: Callable[[], T], timeout_s: float = 60.0, what: str = "condition", *,
             interval_s: float = 0.2, detail: Optional[Callable[[], str]] = None,
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns something truthy, and return
    that; after ``timeout_s`` raise ``WaitTimeout`` naming ``what`` (and ``detail()``, if
    given, for the state at the end). The predicate is always asked at least once."""
    deadline = clock() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if clock() >= deadline:
            extra = f": {detail()}" if detail is not None else ""
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}{extra}")
        sleep(interval_s)
