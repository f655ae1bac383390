"""The sdc probe (digest, fault hook, recorded values) and the sweep's majority comparison."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clusterops.health.probes import sdc
from clusterops.health.probes.base import ProbeContext
from clusterops.sweep.results import NodeResult, mark_sdc_outliers, sdc_verdicts
from clusterops.sweep.policy import NodeSnapshot, plan_drains

torch = pytest.importorskip("torch")

CFG = {"size": 64, "iterations": 3, "seed": 7}
DIGEST_CODE = ("import torch; from clusterops.health.probes import sdc; from clusterops.health.probes.base "
               "import ProbeContext; r = sdc.probe_sdc({'size': 64, 'iterations': 3, 'seed': 7}, "
               "ProbeContext(env={}, node='n1'))[0]; print(r.value)")


def run(cfg=CFG, env=None, node="n1"):
    return sdc.probe_sdc(dict(cfg), ProbeContext(env=env or {}, node=node))[0]


def test_digest_is_the_same_in_two_processes():
    digests = {subprocess.run([sys.executable, "-c", DIGEST_CODE], capture_output=True, text=True,
                              check=True).stdout.strip() for _ in range(2)}
    assert len(digests) == 1 and len(next(iter(digests))) == 32
    assert digests == {run().value}


def test_flip_hook_changes_the_digest_only_on_its_node():
    clean = run()
    assert clean.status == "pass" and clean.data["model_key"].startswith(f"cpu:{torch.__version__}:")
    for bit in (0, 17, 31):
        flipped = run(env={sdc.FAULT_ENV: f"flip:{bit}"})
        assert flipped.value != clean.value and flipped.data["fault_injected"] == f"flip:{bit}"
    assert run(env={sdc.FAULT_ENV: "flip:3@n2"}, node="n1").value == clean.value
    assert run(env={sdc.FAULT_ENV: "flip:3@n2"}, node="n2").value != clean.value
    with pytest.raises(ValueError):
        sdc.parse_fault("flop:3", "n1")


def test_recorded_value_mismatch_fails_and_match_passes(tmp_path):
    clean = run()
    key = clean.data["model_key"]
    assert run(dict(CFG, expected={key: clean.value})).status == "pass"
    bad = run(dict(CFG, expected={key: "0" * 32}))
    assert bad.status == "fail" and "differs from the recorded" in bad.detail
    # The data file, keyed by workload: a digest of another workload is not compared.
    f = tmp_path / "d.yaml"
    ones, twos, wl = "1" * 32, "2" * 32, clean.data["workload"]
    f.write_text(f'workloads:\n  "{wl}":\n    "{key}": "{ones}"\n'
                 f'  "v1 size=1 iterations=1 seed=1 dtype=float32":\n    "{key}": "{twos}"\n')
    assert run(dict(CFG, digests_file=str(f))).status == "fail"
    # The profile's `expected` is over the file.
    assert run(dict(CFG, digests_file=str(f), expected={key: clean.value})).status == "pass"


def test_bad_digests_file_is_an_error_naming_the_file(tmp_path):
    from clusterops.errors import InputError

    f = tmp_path / "d.yaml"
    f.write_text("workload: {}\n")
    with pytest.raises(InputError, match="d.yaml"):
        sdc.load_recorded(str(f))


def test_devices_of_one_node_that_disagree_fail():
    r = sdc.judge({"cuda:0": ("H", "a" * 32), "cuda:1": ("H", "a" * 32), "cuda:2": ("H", "b" * 32)}, {}, "w")
    assert r.status == "fail" and "disagree" in r.detail and r.value == "a" * 32


def d(**nodes):
    return {n: ("m", dig) for n, dig in nodes.items()}


def test_majority_logic():
    assert sdc_verdicts(d(n1="a", n2="a", n3="a", n4="a")) == {}
    v = sdc_verdicts(d(n1="a", n2="a", n3="b", n4="a"))
    assert list(v) == ["n3"] and v["n3"][0] == "fail"
    assert "differs from the majority of 4 nodes of model m" in v["n3"][1]
    assert sdc_verdicts(d(n1="a", n2="a", n3="b"))["n3"][0] == "fail"       # 2 of 3 is a majority
    # Ties, three-way splits and groups of 2: ambiguous, everyone warns, nobody fails.
    for case in (d(n1="a", n2="a", n3="b", n4="b"), d(n1="a", n2="b", n3="c"), d(n1="a", n2="b")):
        v = sdc_verdicts(case)
        assert set(v) == set(case) and {s for s, _ in v.values()} == {"warn"}
    # Groups are per model key: one node of another model is not a minority.
    mixed = dict(d(n1="a", n2="a", n3="a"), n4=("other", "z"))
    assert sdc_verdicts(mixed) == {}


def node(name, digest, status="pass", key="m"):
    return NodeResult(name, status, probes=[{"name": "sdc", "status": status, "value": digest,
                                             "data": {"model_key": key}}])


def test_minority_node_is_drained_through_the_plan_and_guard():
    results = {f"node{i}": node(f"node{i}", "b" if i == 3 else "a") for i in range(1, 5)}
    mark_sdc_outliers(results)
    assert results["node3"].status == "fail" and results["node3"].probe == "sdc"
    snaps = {n: NodeSnapshot(n) for n in results}
    plan = plan_drains(snaps, results, {}, max_drain_fraction=0.5)
    assert [a.node for a in plan.drains] == ["node3"]
    assert plan.drains[0].reason.startswith("clusterops:sweep: sdc: sdc digest differs from the majority of 4")
    # A tie drains nobody.
    tie = {f"node{i}": node(f"node{i}", "b" if i > 2 else "a") for i in range(1, 5)}
    mark_sdc_outliers(tie)
    assert {r.status for r in tie.values()} == {"warn"}
    assert plan_drains(snaps, tie, {}, max_drain_fraction=0.5).drains == []
    # An sdc error (a crash) is not compared: the other three agree, nobody is blamed.
    err = {f"node{i}": node(f"node{i}", "a") for i in range(1, 4)}
    err["node4"] = NodeResult("node4", "pass", probes=[{"name": "sdc", "status": "error", "value": None}])
    assert mark_sdc_outliers(err) == {} and err["node4"].status == "pass"
