"""The drain rules as pure functions: reasons and their origins, who may resume what, the fleet guard."""

from __future__ import annotations

import pytest

from clusterops import drains
from clusterops.drains import (BY_ADMIN, BY_HEALTH, BY_SWEEP, GuardSettings, Resumer, guard_drain,
                               guard_settings, make_reason, may_resume, parse_reason, rechecked_probes)
from clusterops.errors import InputError
from clusterops.slurm.parse import NodeInfo
from support.fakes import FleetSlurm

# -- reasons ----------------------------------------------------------------------------------


def test_reasons_round_trip_with_origin_profile_and_probe():
    text = make_reason("health", "host.paths", "host.path:/scratch: /scratch is missing", profile="deep")
    assert text == "clusterops:health:deep: host.paths: host.path:/scratch: /scratch is missing"
    r = parse_reason(text)
    assert (r.origin, r.profile, r.probe, r.detail) == ("health", "deep", "host.paths",
                                                       "host.path:/scratch: /scratch is missing")
    for origin in ("sweep", "supervisor", "straggler", "flapping", "admin"):
        r = parse_reason(make_reason(origin, "p", "d"))
        assert (r.origin, r.profile, r.probe, r.detail) == (origin, None, "p", "d")


@pytest.mark.parametrize("text,origin,probe", [
    ("clusterops: host.path:/x: gone", "legacy", "host.path:/x"),      # before origins
    ("clusterops: supervisor: hang", "legacy", "supervisor"),
    ("clusterops:", "legacy", ""),
    ("clusterops:bogus: x: y", "legacy", "bogus"),                     # unknown origin: still ours
    ("clusterops:health: x: y", "legacy", "health"),                   # health without a profile
    ("clusterops:sweep:fast: x: y", "legacy", "sweep:fast"),           # a profile where none belongs
])
def test_old_and_odd_clusterops_reasons_still_read_as_ours(text, origin, probe):
    r = parse_reason(text)
    assert r is not None and r.origin == origin and r.probe == probe
    assert drains.is_ours(text) and not drains.is_foreign(text)


@pytest.mark.parametrize("text", ["admin: bad fan", "Not responding", "Kill task failed", "CLUSTEROPS: x",
                                  " clusterops: x"])
def test_foreign_reasons(text):
    assert parse_reason(text) is None and drains.is_foreign(text) and not drains.is_ours(text)


def test_empty_reason_belongs_to_nobody():
    assert not drains.is_foreign(None) and not drains.is_foreign("") and not drains.is_ours("")


def test_reason_is_one_bounded_line_and_profile_a_safe_token():
    text = make_reason("health", "xid", "line one\nline two " + "x" * 500, profile="my site: fast")
    assert "\n" not in text and len(text) <= drains.MAX_REASON_CHARS and text.endswith("...")
    assert text.startswith("clusterops:health:my_site__fast: xid: line one line two")
    assert parse_reason(text).profile == "my_site__fast"
    with pytest.raises(ValueError):
        make_reason("nobody", "x")
    with pytest.raises(ValueError):
        make_reason("health", "x")            # a health drain names its profile
    with pytest.raises(ValueError):
        make_reason("sweep", "x", profile="fast")


# -- who may resume what ------------------------------------------------------------------------

def res(name, status, probe=None):
    return {"name": name, "status": status, "probe": probe or name}


def test_rechecked_probes_are_the_ones_that_ran_and_passed():
    got = rechecked_probes([res("nvml", "pass"), res("nvml.ecc", "warn", "nvml"),
                            res("host.path:/a", "pass", "host.paths"), res("host.path:/b", "fail", "host.paths"),
                            res("dcgm", "skip"), res("xid", "error"), res("host.cpus", "pass"),
                            res("host.cpus", "skip")])
    assert got == {"nvml", "nvml.ecc", "host.path:/a", "host.cpus"}


HEALTH_FAST_PATHS = "clusterops:health:fast: host.paths: host.path:/x: gone"
HEALTH_DEEP_DCGM = "clusterops:health:deep: dcgm: dcgm.diag: memory test failed"
HEALTH_DEEP_PATHS = "clusterops:health:deep: host.paths: host.path:/x: gone"
HEALTH_PREFLIGHT_MATMUL = "clusterops:health:preflight: matmul: 400 TFLOPS < 714"
HEALTH_SITE_PATHS = "clusterops:health:site-fast: host.paths: host.path:/x: gone"
LEGACY_PATHS = "clusterops: host.path:/x: gone"
LEGACY_SUPERVISOR = "clusterops: supervisor: hang"
SWEEP = "clusterops:sweep: host.path:/x: gone"
SUPERVISOR = "clusterops:supervisor: preflight fail: host.paths: gone"
STRAGGLER = "clusterops:straggler: matmul_tflops: below the fleet median"
FLAPPING = "clusterops:flapping: 3/5: failed 3 of the last 5 sweeps"
ADMIN = "clusterops:admin: swap DIMM B3"
FOREIGN = "RMA ticket 42"

FAST_RAN = frozenset({"nvml", "xid", "host.paths", "host.path:/x", "host.memory"})
DEEP_RAN = FAST_RAN | {"dcgm", "dcgm.diag", "matmul", "dist"}
PREFLIGHT_RAN = FAST_RAN | {"matmul", "dist"}


def fast(rechecked=FAST_RAN):
    return Resumer(BY_HEALTH, "fast", frozenset(rechecked))


# (reason, who, may resume?)
TABLE = [
    # a passing health check lifts only what it re-checked, at its depth or shallower
    (HEALTH_FAST_PATHS, fast(), True),
    (HEALTH_FAST_PATHS, fast(FAST_RAN - {"host.paths"}), False),        # did not re-check host.paths
    (HEALTH_DEEP_DCGM, fast(), False),                                  # fast ran no dcgm
    (HEALTH_DEEP_PATHS, fast(), False),                                 # ran it, but shallower
    (HEALTH_DEEP_DCGM, Resumer(BY_HEALTH, "deep", DEEP_RAN), True),
    (HEALTH_DEEP_DCGM, Resumer(BY_HEALTH, "preflight", PREFLIGHT_RAN | {"dcgm"}), False),
    (HEALTH_PREFLIGHT_MATMUL, Resumer(BY_HEALTH, "deep", DEEP_RAN), True),
    (HEALTH_PREFLIGHT_MATMUL, Resumer(BY_HEALTH, "preflight", PREFLIGHT_RAN), True),
    (HEALTH_FAST_PATHS, Resumer(BY_HEALTH, "site-fast", FAST_RAN), False),   # unknown depth
    (HEALTH_SITE_PATHS, Resumer(BY_HEALTH, "site-fast", FAST_RAN), True),    # its own profile
    (HEALTH_SITE_PATHS, fast(), False),
    (LEGACY_PATHS, fast(), True),                                       # old health drain, re-checked
    (LEGACY_PATHS, fast(FAST_RAN - {"host.path:/x"}), False),
    (LEGACY_SUPERVISOR, fast(), False),
    (SWEEP, fast(), False),                                             # other origins wait for a sweep
    (SUPERVISOR, fast(), False),
    (STRAGGLER, fast(), False),
    (FLAPPING, fast(), False),
    (ADMIN, fast(), False),
    (FOREIGN, fast(), False),
    (None, fast(), False),
    # a sweep the node passed
    (SWEEP, Resumer(BY_SWEEP, "fast", FAST_RAN), True),
    (SUPERVISOR, Resumer(BY_SWEEP, "fast", FAST_RAN), True),
    (STRAGGLER, Resumer(BY_SWEEP, "fast", FAST_RAN), True),
    (LEGACY_SUPERVISOR, Resumer(BY_SWEEP, "fast", FAST_RAN), True),
    (LEGACY_PATHS, Resumer(BY_SWEEP, "fast", frozenset()), True),
    (FLAPPING, Resumer(BY_SWEEP, "fast", FAST_RAN, flap_clean=True), True),
    (FLAPPING, Resumer(BY_SWEEP, "fast", FAST_RAN, flap_clean=False), False),
    (HEALTH_FAST_PATHS, Resumer(BY_SWEEP, "fast", FAST_RAN), True),
    (HEALTH_DEEP_DCGM, Resumer(BY_SWEEP, "fast", FAST_RAN), False),     # a fast sweep does not undo deep
    (HEALTH_DEEP_DCGM, Resumer(BY_SWEEP, "deep", DEEP_RAN), True),
    (ADMIN, Resumer(BY_SWEEP, "deep", DEEP_RAN), False),
    (FOREIGN, Resumer(BY_SWEEP, "deep", DEEP_RAN), False),
    # an administrator lifts any clusterops drain, never a foreign one
    (HEALTH_DEEP_DCGM, Resumer(BY_ADMIN), True),
    (ADMIN, Resumer(BY_ADMIN), True),
    (FLAPPING, Resumer(BY_ADMIN), True),
    (LEGACY_PATHS, Resumer(BY_ADMIN), True),
    (FOREIGN, Resumer(BY_ADMIN), False),
]


@pytest.mark.parametrize("reason,who,expected", TABLE)
def test_who_may_resume_what(reason, who, expected):
    ok, why = may_resume(reason, who)
    assert ok is expected, why
    assert why and "\n" not in why


def test_refusals_say_why():
    assert "someone else" in may_resume(FOREIGN, Resumer(BY_ADMIN))[1]
    assert "not as deep" in may_resume(HEALTH_DEEP_PATHS, fast())[1]
    assert "waits for a sweep" in may_resume(SUPERVISOR, fast())[1]
    assert "flapping" in may_resume(FLAPPING, Resumer(BY_SWEEP, "fast", FAST_RAN, flap_clean=False))[1]


# -- the fleet guard ------------------------------------------------------------------------------

def node(name, reason=None, drained=None, parts=("batch",), state="idle"):
    flags = frozenset({"DRAIN"}) if (drained if drained is not None else bool(reason)) else frozenset()
    return NodeInfo(name, state, flags, reason=reason, partitions=tuple(parts))


def fleet(n, drained_by_us=0, foreign=0, parts=("batch",)):
    out = []
    for i in range(1, n + 1):
        reason = None
        if i <= drained_by_us:
            reason = f"clusterops:health:fast: xid: Xid 79 on {i}"
        elif i <= drained_by_us + foreign:
            reason = "admin: bad fan"
        out.append(node(f"n{i}", reason, parts=parts))
    return out


def test_guard_allows_the_first_drain_of_a_small_partition():
    v = guard_drain("n4", fleet(4), GuardSettings(0.1))
    assert v.allowed and (v.drained, v.total, v.limit) == (0, 4, 1)


def test_guard_refuses_past_the_fraction_in_one_line():
    v = guard_drain("n4", fleet(4, drained_by_us=1), GuardSettings(0.1))
    assert not v.allowed and (v.drained, v.total, v.limit, v.partition) == (1, 4, 1, "batch")
    assert "NOT draining n4" in v.message and "\n" not in v.message
    # A bigger fraction, or a bigger partition, leaves room.
    assert guard_drain("n4", fleet(4, drained_by_us=1), GuardSettings(0.5)).allowed
    assert guard_drain("n100", fleet(100, drained_by_us=9), GuardSettings(0.1)).allowed
    assert not guard_drain("n100", fleet(100, drained_by_us=10), GuardSettings(0.1)).allowed


def test_guard_counts_only_clusterops_drains_and_not_a_redrain():
    # Administrators' drains are not ours to count.
    assert guard_drain("n4", fleet(4, foreign=2), GuardSettings(0.1)).allowed
    # A node already carrying our drain is not a new drain (its reason may be updated).
    f = fleet(4, drained_by_us=2)
    assert guard_drain("n1", f, GuardSettings(0.1)).allowed
    assert not guard_drain("n3", f, GuardSettings(0.1)).allowed
    # A down node that carries our reason counts; Slurm's own "Not responding" does not.
    f = [node("n1", "clusterops:supervisor: lost", drained=False, state="down"),
         node("n2", "Not responding", drained=False, state="down"), node("n3"), node("n4")]
    assert not guard_drain("n3", f, GuardSettings(0.1)).allowed
    f[0] = node("n1", "Not responding", drained=False, state="down")
    assert guard_drain("n3", f, GuardSettings(0.1)).allowed


def test_guard_fraction_zero_refuses_all_and_one_allows_all():
    assert not guard_drain("n1", fleet(10), GuardSettings(0.0)).allowed
    assert guard_drain("n10", fleet(10, drained_by_us=9), GuardSettings(1.0)).allowed


def test_guard_per_partition():
    # n1 is in gpu and debug; gpu is full of our drains, debug is not: refused (any partition counts).
    f = [node("n1", parts=("gpu", "debug"))] + [node(f"g{i}", "clusterops:sweep: x: y", parts=("gpu",))
                                               for i in range(2)] + \
        [node(f"g{i}", parts=("gpu",)) for i in range(2, 10)] + [node(f"d{i}", parts=("debug",)) for i in range(9)]
    v = guard_drain("n1", f, GuardSettings(0.1))
    assert not v.allowed and v.partition == "gpu" and (v.drained, v.total, v.limit) == (2, 11, 1)
    # The site may name the partition to count instead.
    v = guard_drain("n1", f, GuardSettings(0.1, partition="debug"))
    assert v.allowed and v.partition == "debug" and v.total == 10


def test_guard_settings_from_site_and_environment():
    assert guard_settings({}, None, {}) == GuardSettings(0.1, None)
    site = {"drain": {"max_drained_fraction": 0.25, "partition": "gpu"}}
    assert guard_settings(site, "site.yaml", {}) == GuardSettings(0.25, "gpu")
    assert guard_settings(site, "site.yaml", {drains.FRACTION_ENV: "0.5"}) == GuardSettings(0.5, "gpu")


@pytest.mark.parametrize("site,env,needle", [
    ({"drain": {"max_drained_fraction": 1.5}}, {}, "site.yaml: drain.max_drained_fraction"),
    ({"drain": {"max_drained_fraction": "lots"}}, {}, "drain.max_drained_fraction"),
    ({"drain": {"max_drained_fraction": True}}, {}, "drain.max_drained_fraction"),
    ({"drain": {"max_drain_fraction": 0.2}}, {}, "drain.max_drain_fraction: unknown key"),
    ({"drain": {"partition": "a b"}}, {}, "drain.partition"),
    ({"drain": [0.1]}, {}, "drain: must be a mapping"),
    ({}, {drains.FRACTION_ENV: "-0.1"}, "$CLUSTEROPS_MAX_DRAINED_FRACTION"),
])
def test_bad_guard_settings_are_input_errors(site, env, needle):
    with pytest.raises(InputError) as ei:
        guard_settings(site, "site.yaml", env)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_the_drain_rule_lives_in_one_module():
    """Reasons are built and recognised only through clusterops.drains (reads the tree)."""
    import re
    from pathlib import Path

    root = Path(drains.__file__).resolve().parent
    pattern = re.compile(r"""startswith\(\s*["']clusterops:|f["']clusterops:|=\s*["']clusterops:""")
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "drains.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


# -- the guard under concurrency (drains.excess_drain, drain_apply.apply_drain) -----------------

class Clock:
    def __init__(self, t=1_800_000_000.25):
        self.t = t

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += max(s, 0)


def _storm(slurm, clock, names, guard, reason="clusterops:sweep: probe: bad driver push"):
    """Every node reads a healthy fleet, then every node drains, then each confirms: the race
    the guard's pre-check alone loses (16 of 16 drained, DESIGN.md)."""
    from clusterops import drain_apply as da

    fleets = {n: slurm.nodes() for n in names}          # all read before anyone drains
    gen = {}
    for n in names:
        # apply_drain up to and including its drain, with the stale fleet each one read.
        gen[n] = da.apply_drain(slurm, n, reason, guard, fleet=fleets[n], clock=clock, sleep=clock.sleep)
    return gen


def test_every_node_failing_at_once_leaves_at_most_the_limit_drained():
    from clusterops import drain_apply as da

    clock = Clock()
    slurm = FleetSlurm(16, clock=clock)
    guard = GuardSettings(0.25)
    out = _storm(slurm, clock, list(slurm.state), guard)
    # The first four by (drain time, name) keep their drain; the twelve others lifted their own.
    assert slurm.drained() == ["n01", "n02", "n03", "n04"]
    undone = [o for o in out.values() if o.action == da.UNDONE]
    assert len(undone) == 12 and all(o.why.startswith("guard: undone: ") and "\n" not in o.why for o in undone)
    assert "allows 4" in undone[0].why and "number 5" in out["n05"].why


def test_sixteen_drains_in_one_second_then_sixteen_rereads_keep_the_first_four_by_name():
    from clusterops import drain_apply as da

    clock = Clock()
    slurm = FleetSlurm(16, clock=clock)
    guard = GuardSettings(0.25)
    reason = "clusterops:health:fast: host.load: bad config push"
    names = list(slurm.state)
    for n in reversed(names):                      # every drain lands in the same second
        slurm.drain([n], reason)
    outs = [da._confirm(slurm, n, reason, guard, da.DrainOutcome(n, da.DRAINED, "drained", reason),
                        da.DEFAULT_SETTLE_S, clock, clock.sleep) for n in reversed(names)]
    assert slurm.drained() == ["n01", "n02", "n03", "n04"]
    assert sum(o.action == da.UNDONE for o in outs) == 12


def test_drains_made_before_the_storm_count_first_and_later_seconds_sort_later():
    from clusterops import drain_apply as da

    clock = Clock()
    slurm = FleetSlurm(8, clock=clock)            # limit 2 at 0.25
    slurm.state["n07"].update(drained=True, reason="clusterops:admin: swap PSU", time=clock.t - 3600)
    clock.t += 5
    guard = GuardSettings(0.25)
    out = _storm(slurm, clock, ["n01", "n02", "n03"], guard)
    # n07's older drain holds one place: only n01 (first by name of the same second) keeps.
    assert slurm.drained() == ["n01", "n07"]
    assert out["n01"].action == da.DRAINED and out["n01"].excess["ahead"] == ["n07"]
    assert {out[n].action for n in ("n02", "n03")} == {da.UNDONE}


def test_a_drain_in_the_same_second_but_later_is_waited_for():
    """A drain later in the same second sorts first by name: the re-read waits past the
    second, so the later one is seen and only one of the two stays under a limit of one."""
    from clusterops import drain_apply as da

    clock = Clock(1_800_000_000.1)
    slurm = FleetSlurm(4, clock=clock)           # limit 1 at 0.25
    guard = GuardSettings(0.25)
    stale = slurm.nodes()
    real_nodes = slurm.nodes

    def nodes_then_a_rival(names=None):
        # Between n02's drain and its re-read, n01 drains in the same second.
        if slurm.state["n02"]["drained"] and not slurm.state["n01"]["drained"]:
            slurm.drain(["n01"], "clusterops:sweep: p: d")
        return real_nodes(names)

    slurm.nodes = nodes_then_a_rival
    out = da.apply_drain(slurm, "n02", "clusterops:sweep: p: d", guard, fleet=stale, clock=clock, sleep=clock.sleep)
    assert out.action == da.UNDONE and slurm.drained() == ["n01"]
    assert clock.t >= 1_800_000_001 + da.DEFAULT_SETTLE_S     # waited past the drain's second


def test_a_reread_that_fails_lifts_the_fresh_drain_and_a_changed_reason_is_left():
    from clusterops import drain_apply as da

    clock = Clock()
    slurm = FleetSlurm(4, clock=clock)
    guard = GuardSettings(1.0)
    real_drain = slurm.drain

    def drain_then_controller_goes(nodes, reason):
        real_drain(nodes, reason)
        slurm.fail_reads = True

    slurm.drain = drain_then_controller_goes
    out = da.apply_drain(slurm, "n01", "clusterops:sweep: p: d", guard, clock=clock, sleep=clock.sleep)
    # The resume reads too (FleetSlurm fails it): the node stays drained and says so.
    assert out.action == da.DRAINED and not out.ok and "could not be re-read" in out.why and "left drained" in out.why
    slurm.fail_reads = False
    slurm.drain = real_drain
    # An administrator relabels our fresh drain before our re-read: over the limit, but not ours to lift.
    slurm2 = FleetSlurm(4, clock=clock)
    slurm2.state["n04"].update(drained=True, reason="clusterops:sweep: old", time=clock.t - 100)
    real2 = slurm2.drain

    def drain_then_admin(nodes, reason):
        real2(nodes, reason)
        slurm2.state["n01"]["reason"] = "clusterops:admin: keep this one"

    slurm2.drain = drain_then_admin
    stale = [n for n in slurm2.nodes() if n.name != "n04"]      # n04's drain not seen before
    out = da.apply_drain(slurm2, "n01", "clusterops:sweep: p: d", GuardSettings(0.25), fleet=stale,
                         clock=clock, sleep=clock.sleep)
    assert out.action == da.DRAINED and "no longer the one written" in out.why
    assert slurm2.drained() == ["n01", "n04"]


@pytest.mark.parametrize("down,drained", [(True, False), (False, True), (True, True)])
def test_down_or_drained_with_someone_elses_reason_is_kept(down, drained):
    from clusterops import drain_apply as da

    clock = Clock()
    slurm = FleetSlurm(4, clock=clock)
    slurm.state["n02"].update(down=down, drained=drained, reason="Not responding", time=clock.t)
    out = da.apply_drain(slurm, "n02", "clusterops:supervisor: hang: rank 1", GuardSettings(1.0))
    assert out.action == da.KEPT and "someone else" in out.why
    assert slurm.state["n02"]["reason"] == "Not responding" and "drain" not in slurm.calls


def test_excess_drain_orders_by_time_then_name_and_unknown_times_last():
    def n(name, t, reason="clusterops:sweep: x"):
        return NodeInfo(name, "idle", frozenset({"DRAIN"}), reason, "root", t, partitions=("p",))

    idle = [NodeInfo(f"i{k}", "idle", partitions=("p",)) for k in range(4)]
    fleet = [n("b", 10.0), n("a", 10.0), n("c", None), n("d", 5.0)] + idle     # 8 nodes: limit 2 at 0.25
    v = {x.name: drains.excess_drain(x.name, fleet, GuardSettings(0.25)) for x in fleet[:4]}
    assert [k for k in "abcd" if v[k].keep] == ["a", "d"]
    assert v["b"].rank == 3 and v["c"].rank == 4 and v["b"].ahead == ("d", "a")
    assert drains.excess_drain("i0", fleet, GuardSettings(0.25)).keep       # no drain of its own


def test_reason_never_ends_with_a_double_quote_that_scontrol_would_drop():
    text = make_reason("admin", "ticket", 'user said "drain it"')
    assert text == 'clusterops:admin: ticket: user said "drain it".' and parse_reason(text).origin == "admin"


def test_an_sdc_drain_is_lifted_only_by_a_passing_sdc_probe():
    r = drains.make_reason(drains.SDC, "ranks 1", "replicas differ at step 25")
    assert drains.parse_reason(r).origin == drains.SDC
    assert not drains.may_resume(r, Resumer(BY_HEALTH, "fast", frozenset({"nvml", "host"})))[0]
    assert not drains.may_resume(r, Resumer(BY_SWEEP, "fast", frozenset({"nvml"})))[0]
    assert drains.may_resume(r, Resumer(BY_HEALTH, "deep", frozenset({"nvml", "sdc"})))[0]
    assert drains.may_resume(r, Resumer(BY_SWEEP, "deep", frozenset({"sdc"})))[0]
    assert drains.may_resume(r, Resumer(BY_ADMIN))[0]
