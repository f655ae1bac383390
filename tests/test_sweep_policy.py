"""The sweep's pure parts: judging a check, fleet stragglers, the drain policy and its guard."""

from __future__ import annotations

import pytest

from clusterops.errors import InputError
from clusterops.sweep import (NodeResult, NodeSnapshot, allowed_drains, drain_reason, extract_metrics,
                              mark_stragglers, parse_times, plan_drains, result_from_check)


def check_doc(status="pass", results=None, node="n1"):
    return {"node": node, "profile": "fast", "status": status, "exit_code": 0, "duration_s": 0.4,
            "results": results or []}


def probe(name, status="pass", value=None, unit=None, detail=""):
    return {"name": name, "status": status, "value": value, "unit": unit, "threshold": None,
            "detail": detail, "duration_s": 0.01, "data": {}}


# -- judging one check ------------------------------------------------------------------

def test_failing_probe_gives_status_probe_and_detail():
    doc = check_doc("fail", [probe("host.memory"), probe("host.paths", "fail", detail="/scratch missing: fix mount")])
    r = result_from_check("n1", doc, 1)
    assert (r.status, r.probe, r.detail) == ("fail", "host.paths", "/scratch missing: fix mount")
    assert r.failing and not r.healthy


def test_exit_code_is_the_contract():
    # A document that says pass but exits 1 is unhealthy; exit 2 is a usage error, not the node's fault.
    assert result_from_check("n1", check_doc("pass"), 1).status == "fail"
    r = result_from_check("n1", check_doc("fail", [probe("x", "fail")]), 2)
    assert r.status == "error" and not r.failing and not r.checked


def test_garbage_output_never_passes():
    r = result_from_check("n1", None, 0, stderr="Traceback...\nImportError: no module yaml\n")
    assert r.status == "fail" and "ImportError" in r.detail
    r = result_from_check("n1", None, None)
    assert r.status == "error"


def test_error_probe_counts_as_failure():
    r = result_from_check("n1", check_doc("error", [probe("host.mounts", "error", detail="stat timed out")]), 1)
    assert r.status == "fail" and r.failing and r.probe == "host.mounts"


def test_check_exit_4_is_an_error_never_a_failure_and_3_is_a_failure():
    # 4: the check could not decide (a probe raised): the sweep does not judge the node on it.
    r = result_from_check("n1", check_doc("error", [probe("host.memory", "error", detail="probe raised")]), 4)
    assert r.status == "error" and not r.failing and not r.checked
    # 3: the node failed; its own guard kept it from draining itself.
    r = result_from_check("n1", check_doc("fail", [probe("host.paths", "fail", detail="gone")]), 3)
    assert r.status == "fail" and r.failing


def test_metrics_and_stragglers():
    docs = {f"n{i}": check_doc("pass", [probe("matmul", value=v, unit="TFLOPS"),
                                        probe("allreduce", value=b, unit="GB/s")])
            for i, (v, b) in enumerate([(100, 50), (98, 51), (101, 49), (80, 50), (99, 30)], 1)}
    results = {n: result_from_check(n, d, 0) for n, d in docs.items()}
    assert extract_metrics(docs["n1"]["results"]) == {"matmul_tflops": 100.0, "busbw_gbps": 50.0}
    med = mark_stragglers(results, 0.10)
    assert med == {"matmul_tflops": 99.0, "busbw_gbps": 50.0}
    assert results["n4"].stragglers == ["matmul_tflops"]     # 80 < 0.9 * 99 although it "passes"
    assert results["n5"].stragglers == ["busbw_gbps"]
    assert not results["n1"].stragglers and not results["n2"].stragglers
    # Two nodes are not a fleet: no verdict.
    two = {n: results[n] for n in ("n1", "n4")}
    mark_stragglers(two, 0.10)
    assert not two["n4"].stragglers


def test_parse_times():
    assert parse_times("0\n0m0.003s 0m0.000s\n0m0.084s 0m0.017s\n") == pytest.approx(0.101)
    assert parse_times("1m2.5s 0m0.5s") is None
    assert parse_times("") is None


# -- the drain policy -------------------------------------------------------------------

def res(node, status, detail="", probe="host.paths"):
    return NodeResult(node, status, detail=detail, probe=probe if status in ("fail",) else "")


def snaps(**kw):
    return {n: NodeSnapshot(n, **v) for n, v in kw.items()}


def acts(plan):
    return {a.node: a.action for a in plan.actions}


def test_drains_failing_resumes_recovered_and_leaves_admin_drains_alone():
    nodes = snaps(n1={}, n2={"drained": True, "reason": "admin: bad fan"},
                  n3={}, n4={"drained": True, "reason": "clusterops: host.paths: gone"},
                  n5={}, n6={}, n7={}, n8={}, n9={}, n10={})
    results = {n: res(n, "pass") for n in nodes}
    results["n2"] = res("n2", "fail", "disk")          # failing, but someone else's drain
    results["n3"] = res("n3", "fail", "/scratch missing")
    plan = plan_drains(nodes, results, {}, max_drain_fraction=0.1)
    a = acts(plan)
    assert a["n3"] == "drain" and a["n4"] == "resume" and a["n2"] == "untouched"
    assert plan.drains[0].reason == "clusterops:sweep: host.paths: /scratch missing"
    assert not plan.guard_tripped


def test_never_resumes_a_foreign_reason_even_when_healthy():
    nodes = snaps(n1={"drained": True, "reason": "RMA ticket 42"}, n2={"down": True, "reason": "Not responding"})
    plan = plan_drains(nodes, {"n1": res("n1", "pass"), "n2": res("n2", "pass")}, {})
    assert acts(plan) == {"n1": "untouched", "n2": "untouched"}


def test_guard_drains_none_when_too_many_would_go():
    nodes = snaps(n1={}, n2={}, n3={}, n4={})
    results = {"n1": res("n1", "pass"), "n2": res("n2", "fail", "x"), "n3": res("n3", "fail", "x"),
               "n4": res("n4", "unreachable", "no answer")}
    plan = plan_drains(nodes, results, {}, max_drain_fraction=0.1)
    assert plan.guard_tripped and plan.drains == [] and "SAFETY GUARD" in plan.message
    assert "3 of 4" in plan.message


def test_guard_allowance():
    assert allowed_drains(4, 0.1) == 1         # one bad node in a small pool is still drainable
    assert allowed_drains(256, 0.1) == 25
    assert allowed_drains(10, 0.0) == 0
    assert allowed_drains(0, 0.5) == 0


def test_unreachable_is_never_healthy_and_skipped_is_not_judged():
    nodes = snaps(n1={}, n2={}, n3={"drained": True, "reason": "clusterops: x: y"})
    results = {"n1": res("n1", "unreachable", "no result in 60s"), "n2": res("n2", "skipped", "busy"),
               "n3": res("n3", "unreachable", "no result")}
    plan = plan_drains(nodes, results, {}, max_drain_fraction=1.0)
    assert acts(plan) == {"n1": "drain", "n2": "untouched", "n3": "keep"}


def test_flapping_drains_a_node_that_passes_today():
    nodes = snaps(**{f"n{i}": {} for i in range(1, 11)})
    results = {n: res(n, "pass") for n in nodes}
    # n1 failed 2 of its last 4 (newest first) and passes today: 2 of 5 < k=3 -> fine.
    # n2 failed 3 of its last 4: 3 of 5 -> flapping.
    hist = {"n1": [True, False, True, False], "n2": [True, True, False, True, True, True]}
    plan = plan_drains(nodes, results, hist, flap_k=3, flap_n=5, max_drain_fraction=0.5)
    a = {x.node: x for x in plan.actions}
    assert a["n1"].action == "untouched"
    assert a["n2"].action == "drain" and a["n2"].reason.startswith("clusterops:flapping: 3/5: ")
    # Already drained as flapping and still flapping: kept, not resumed.
    nodes["n2"] = NodeSnapshot("n2", drained=True, reason=a["n2"].reason)
    plan = plan_drains(nodes, results, hist, flap_k=3, flap_n=5)
    assert acts(plan)["n2"] == "keep"
    # Once the failures age out of the window it is resumed.
    plan = plan_drains(nodes, results, {"n2": [False, False, False, True]}, flap_k=3, flap_n=5)
    assert acts(plan)["n2"] == "resume"


def test_stragglers_drained_only_when_asked():
    nodes = snaps(n1={}, n2={}, n3={})
    results = {n: res(n, "pass") for n in nodes}
    results["n3"].stragglers = ["matmul_tflops"]
    assert acts(plan_drains(nodes, results, {}, max_drain_fraction=1))["n3"] == "untouched"
    plan = plan_drains(nodes, results, {}, max_drain_fraction=1, drain_stragglers=True)
    assert acts(plan)["n3"] == "drain" and "straggler" in plan.drains[0].reason


def test_reason_is_one_bounded_line():
    r = drain_reason("host.paths", "line one\nline two " + "x" * 500)
    assert r.startswith("clusterops:sweep: host.paths: line one line two")
    assert "\n" not in r and len(r) <= 200


def _passed(node, names, profile="fast"):
    probes = [dict(probe(n), probe=p) for n, p in names]
    return NodeResult(node, "pass", probes=probes, profile=profile)


def test_sweep_resumes_by_origin_and_what_it_rechecked():
    reasons = {
        "n1": "clusterops:sweep: host.path:/x: gone",                          # sweep's own
        "n2": "clusterops:supervisor: hang: rank 3 stopped",                   # waits for a sweep
        "n3": "clusterops:straggler: matmul_tflops: below the fleet median",
        "n4": "clusterops: host.paths: gone",                                  # legacy
        "n5": "clusterops:health:fast: host.paths: host.path:/x: gone",        # re-checked by the sweep
        "n6": "clusterops:health:deep: dcgm: dcgm.diag: memory failed",        # a fast sweep ran no dcgm
        "n7": "clusterops:admin: swap DIMM B3",                                # an administrator's
        "n8": "RMA 42",                                                        # someone else's
    }
    nodes = snaps(**{n: {"drained": True, "reason": r} for n, r in reasons.items()})
    results = {n: _passed(n, [("nvml", "nvml"), ("host.path:/x", "host.paths")]) for n in nodes}
    plan = plan_drains(nodes, results, {}, max_drain_fraction=0.1)
    a = {x.node: x for x in plan.actions}
    assert {n for n, x in a.items() if x.action == "resume"} == {"n1", "n2", "n3", "n4", "n5"}
    assert a["n6"].action == "keep" and a["n6"].reason == reasons["n6"] and "deep" in a["n6"].why
    assert a["n7"].action == "keep" and a["n7"].reason == reasons["n7"]
    assert a["n8"].action == "untouched"
    # A deep sweep that re-ran dcgm lifts the deep drain.
    deep = {"n6": _passed("n6", [("dcgm.diag", "dcgm"), ("nvml", "nvml")], profile="deep")}
    assert acts(plan_drains({"n6": nodes["n6"]}, deep, {}))["n6"] == "resume"


def test_still_failing_keeps_a_reason_the_sweep_could_not_lift():
    deep = "clusterops:health:deep: dcgm: dcgm.diag: memory failed"
    nodes = snaps(n1={"drained": True, "reason": deep}, n2={"drained": True, "reason": "clusterops:sweep: x: y"})
    failing = [dict(probe("host.path:/x", "fail", detail="gone"), probe="host.paths"),
               dict(probe("nvml"), probe="nvml")]
    results = {n: NodeResult(n, "fail", detail="gone", probe="host.path:/x", probes=failing, profile="fast")
               for n in nodes}
    a = {x.node: x for x in plan_drains(nodes, results, {}).actions}
    assert (a["n1"].action, a["n1"].reason) == ("keep", deep)          # the deep drain keeps its owner
    assert (a["n2"].action, a["n2"].reason) == ("keep", "clusterops:sweep: host.path:/x: gone")


def test_sweep_reasons_carry_their_origin():
    nodes = snaps(n1={}, n2={}, n3={})
    results = {"n1": res("n1", "fail", "gone", probe="host.path:/x"), "n2": res("n2", "pass"),
               "n3": res("n3", "pass")}
    results["n2"].stragglers = ["matmul_tflops"]
    plan = plan_drains(nodes, results, {}, max_drain_fraction=1, drain_stragglers=True)
    r = {a.node: a.reason for a in plan.drains}
    assert r == {"n1": "clusterops:sweep: host.path:/x: gone",
                 "n2": "clusterops:straggler: matmul_tflops: below the fleet median"}


@pytest.mark.parametrize("kw", [{"max_drain_fraction": 1.5}, {"flap_k": 6, "flap_n": 5}, {"flap_k": 0}])
def test_bad_policy_input(kw):
    with pytest.raises(InputError):
        plan_drains({}, {}, {}, **kw)
