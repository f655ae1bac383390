"""The property-test harness: run the real ``clusterops`` entry point in-process (through
the same error mapping as the console script) and check the input contract on whatever
comes out: exit 0, 1 or 2; a failure ends with exactly one one-line ``Error:``; never a
traceback; strict JSON when --json succeeded; bounded wall time.

Used by tests/test_props_*.py with hypothesis-generated and mutated inputs.
"""

from __future__ import annotations

import io
import json
import math
import os
import resource
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional, Sequence

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

ALLOWED_CODES = frozenset({0, 1, 2})
MAX_RSS_KIB = 1536 * 1024

# Each property test takes a few seconds at most: few examples, no per-example deadline
# (the harness checks wall time itself), no database of failures kept between runs.
PROPS = settings(max_examples=int(os.environ.get("CLUSTEROPS_PROPS_EXAMPLES", "100")), deadline=None,
                 database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                       HealthCheck.too_slow])


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    wall_s: float

    def json(self):
        return strict_loads(self.stdout)


def _refuse(name):
    raise ValueError(f"not strict JSON: {name}")


def strict_loads(text: str):
    """json.loads that refuses NaN/Infinity, as jq, Go or JavaScript would."""
    return json.loads(text, parse_constant=_refuse)


def run_cli(args: Sequence[str], *, max_wall_s: float = 10.0, env: Optional[dict] = None,
            allowed=ALLOWED_CODES) -> Outcome:
    """Run ``clusterops ARGS`` in-process, capturing stdout/stderr; any exception that
    escapes the CLI's error mapping (a traceback for a user) fails the calling test."""
    from clusterops.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr
    saved_env = {}
    for k, v in (env or {}).items():
        saved_env[k] = os.environ.get(k)
        os.environ[k] = v
    t0 = time.monotonic()
    code: object = 0
    try:
        sys.stdout, sys.stderr = out, err
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code
        except BaseException:  # pragma: no cover - the failure this harness exists to catch
            sys.stdout, sys.stderr = old
            raise AssertionError(f"clusterops {list(args)} raised:\n{traceback.format_exc()}") from None
    finally:
        sys.stdout, sys.stderr = old
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wall = time.monotonic() - t0
    if code is None:
        code = 0
    o = Outcome(code if isinstance(code, int) else -1, out.getvalue(), err.getvalue(), wall)
    check_contract(o, args, max_wall_s=max_wall_s, allowed=allowed)
    return o


def check_contract(o: Outcome, args: Sequence[str], *, max_wall_s: float, allowed=ALLOWED_CODES) -> None:
    """``allowed``: the exit codes this command may end with (0/1/2 unless it documents more,
    like the sweep's 3, 4 and 5); any code but 0 and 1 ends with exactly one ``Error:`` line."""
    where = f"clusterops {' '.join(map(str, args))[:300]}"
    assert o.code in allowed, f"{where}: exit {o.code}\nstderr: {o.stderr[-2000:]}"
    both = o.stdout + o.stderr
    assert "Traceback (most recent call last)" not in both, f"{where}: traceback\n{both[-3000:]}"
    assert o.wall_s <= max_wall_s, f"{where}: took {o.wall_s:.1f}s (bound {max_wall_s}s)"
    # The test process's peak memory (Linux: KiB) stays bounded whatever the input.
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak_kib < MAX_RSS_KIB, f"{where}: peak memory {peak_kib // 1024} MiB"
    if o.code != 0 and o.code != 1:
        lines = [ln for ln in o.stderr.splitlines() if ln.strip()]
        assert lines, f"{where}: exit {o.code} without a message"
        errors = [ln for ln in lines if ln.startswith("Error:")]
        assert len(errors) == 1 and lines[-1] == errors[0], f"{where}: not one error line:\n{o.stderr[-2000:]}"
        assert len(errors[0]) < 2000, f"{where}: error line too long"
    if o.code == 1:
        errors = [ln for ln in o.stderr.splitlines() if ln.startswith("Error:")]
        assert len(errors) <= 1, f"{where}: several error lines:\n{o.stderr[-2000:]}"
    if o.code == 0 and "--json" in args:
        strict_loads(o.stdout)


# -- generators shared by the property tests ---------------------------------------------

def finite_or_not_floats():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 5e-324]))


huge_ints = st.sampled_from([2 ** 63, -(2 ** 63) - 1, 10 ** 30, 10 ** 400, -1, 0, 2 ** 31])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70), huge_ints,
    finite_or_not_floats(), st.text(max_size=40),
    st.sampled_from(["", " ", "\u202e", "日本語", "a\nb", "${HOME}", "$(reboot)", "'\"", "\x00", "~", "-1", "1e999"]),
)

values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=12)


class NoAliasDumper(yaml.SafeDumper):
    """A YAML dumper that never writes anchors/aliases (HEALTHCFG's loader refuses them;
    that path is tested there)."""

    def ignore_aliases(self, data):
        return True


def _represent_float(dumper, value):
    if math.isnan(value):
        return dumper.represent_scalar("tag:yaml.org,2002:float", ".nan")
    if math.isinf(value):
        return dumper.represent_scalar("tag:yaml.org,2002:float", ".inf" if value > 0 else "-.inf")
    return yaml.SafeDumper.represent_float(dumper, value)


NoAliasDumper.add_representer(float, _represent_float)


def dump_yaml(data) -> str:
    return yaml.dump(data, Dumper=NoAliasDumper, allow_unicode=True, sort_keys=False)
