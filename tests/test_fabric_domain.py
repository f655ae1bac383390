"""The GPU fabric's NVLink domain (GB200 NVL72): the NVML probe reads it per GPU through the
pynvml stand-in (tests/fixtures/nvml), the supervisor's plumbing takes it from the nodes'
check reports, and the machine places a replacement in the lost node's NVLink domain first
(fake clock), over Slurm's topology for the nodes that name one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.machine import P, lose, only, records
from clusterops.health import load_gpu_models
from clusterops.health.probes.base import ProbeContext
from clusterops.health.probes.nvml import FABRIC_RESULT, probe_nvml
from clusterops.health.probes.nvml_standin import StandinNVML
from clusterops.supervisor import (CheckpointCommitted, Launch, PreflightDone, ResumeChosen, RunPreflight,
                                   StepExited, Supervisor)
from clusterops.supervisor import machine as sv
from clusterops.supervisor import run as plumbing

FIX = Path(__file__).parent / "fixtures" / "nvml"
NVL72 = "gb200_nvl72_4gpu.json"
UUID = "6f1c2a4e-93b0-4d7e-8a51-2c9e0b7d4f10"
DOMAIN = f"{UUID}/32766"


def doc(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def probe(d: dict, nv=None) -> dict:
    ctx = ProbeContext(nvml=nv or StandinNVML(d), gpu_models=load_gpu_models({}))
    return {r.name: r for r in probe_nvml({}, ctx)}


def fabric(d: dict, nv=None):
    """The fabric result, after checking that nothing else of the node changed its verdict."""
    res = probe(d, nv)
    assert all(r.status in ("pass", "skip") for n, r in res.items() if n != FABRIC_RESULT), \
        {n: r.detail for n, r in res.items() if r.status not in ("pass", "skip")}
    return res[FABRIC_RESULT]


# ------------------------------------------------------------------------------ the probe
def test_an_nvl72_node_names_its_nvlink_domain_and_the_report_carries_it():
    r = fabric(doc(NVL72))
    assert r.status == "pass" and r.value == DOMAIN and r.data["fabric"] == DOMAIN
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/\d+", r.value)
    assert set(r.data["gpus"].values()) == {DOMAIN} and len(r.data["gpus"]) == 4
    # What the supervisor reads of the node's JSON report: the same domain.
    report = json.loads(json.dumps({"node": "g1", "status": "pass",
                                    "results": [x.to_dict() for x in probe(doc(NVL72)).values()]}))
    assert plumbing.fabric_of(report["results"]) == DOMAIN


@pytest.mark.parametrize("name", ["h100_sxm_8gpu_idle.json", "h100_sxm_8gpu_driver570.json",
                                  "a100_sxm_8gpu_busy.json", "v100_sxm2_4gpu.json", "l4_pcie_1gpu.json"])
def test_gpus_without_a_fabric_skip_and_name_no_domain(name):
    d = doc(name)
    res = probe(d)
    r = res[FABRIC_RESULT]
    assert r.status == "skip" and r.data["fabric"] is None
    assert plumbing.fabric_of([x.to_dict() for x in res.values()]) is None


@pytest.mark.parametrize("value", [
    "not_supported",                                                              # NVML_ERROR_NOT_SUPPORTED
    "function_not_found",                                                         # a driver before the call
    {"state": 0, "status": 0, "cluster_uuid": UUID, "clique_id": 1},              # state NOT_SUPPORTED
    {"state": 3, "status": 0, "cluster_uuid": "00000000-0000-0000-0000-000000000000", "clique_id": 7},
])
def test_no_fabric_is_never_an_error_or_a_fail(value):
    d = doc(NVL72)
    d["template"]["fabric"] = value
    r = fabric(d)
    assert r.status == "skip" and r.data["fabric"] is None and r.value is None


def test_a_driver_without_the_versioned_call_is_read_through_the_first_one():
    d = doc(NVL72)
    d["template"]["fabric_v"] = "function_not_found"
    nv = StandinNVML(d)
    assert fabric(d, nv).data["fabric"] == DOMAIN
    assert nv.calls.count("fabric_v") == 4 and nv.calls.count("fabric") == 4


def test_a_pynvml_without_the_fabric_calls_reads_no_fabric():
    class OldPynvml(StandinNVML):
        c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfoV_t = None

    d = doc(NVL72)
    nv = OldPynvml(d)
    r = fabric(d, nv)
    assert r.status == "skip" and not [c for c in nv.calls if c.startswith("fabric")]


def test_gpus_of_one_node_in_different_domains_warn_and_name_none():
    d = doc(NVL72)
    d["gpus"]["3"]["fabric"] = dict(d["template"]["fabric"], clique_id=5)
    r = fabric(d)
    assert r.status == "warn" and r.data["fabric"] is None and r.value is None
    assert f"GPU0,1,2: {DOMAIN}" in r.detail and f"GPU3: {UUID}/5" in r.detail
    assert "different GPU fabrics" in r.detail


def test_one_gpu_without_the_fabric_is_a_disagreement_too():
    d = doc(NVL72)
    d["gpus"]["1"]["fabric"] = "not_supported"
    r = fabric(d)
    assert r.status == "warn" and r.data["fabric"] is None and "GPU1: no fabric" in r.detail


@pytest.mark.parametrize("value, said", [
    ({"state": 2, "status": 0, "cluster_uuid": UUID, "clique_id": 1}, "state IN_PROGRESS"),
    ({"state": 3, "status": 999, "cluster_uuid": UUID, "clique_id": 1}, "registration failed (NVML status 999)"),
    ("unknown", "unreadable"),
])
def test_a_registration_not_complete_warns_with_no_domain(value, said):
    d = doc(NVL72)
    d["template"]["fabric"] = value
    r = fabric(d)
    assert r.status == "warn" and r.data["fabric"] is None and said in r.detail and "every GPU" in r.detail


@pytest.mark.parametrize("results", [None, {}, [1, "x"], [{"name": FABRIC_RESULT, "data": []}],
                                     [{"name": FABRIC_RESULT, "data": {"fabric": 7}}],
                                     [{"name": FABRIC_RESULT, "data": {"fabric": ""}}],
                                     [{"name": "fabric", "data": {"fabric": DOMAIN}}]])
def test_the_plumbing_takes_a_domain_only_from_a_well_formed_nvml_fabric_result(results):
    assert plumbing.fabric_of(results) is None


# ------------------------------------------------------------------------------ the machine
X, Y = f"{UUID}/1", f"{UUID}/2"


def _after_preflight(slurm, fab, names=("n1", "n2", "n3", "n4"), **policy):
    s = Supervisor(P(nodes=2, spare_nodes=2, node_fail_threshold=1, preflight="preflight", **policy), list(names),
                   domains=slurm)
    acts = s.start(1000.0)
    assert set(only(acts, RunPreflight)[0].nodes) == set(names)    # the spares are checked too
    acts = s.handle(PreflightDone(1001.0, {n: "pass" for n in names}, {}, fabric=fab))
    acts += s.handle(ResumeChosen(1001.0, None, "", ()))
    return s, acts


def test_the_nvlink_domain_from_the_checks_wins_over_slurms_and_places_the_spare():
    # Slurm sees one leaf switch; NVML sees two NVLink domains interleaved with the
    # allocation's order: n2's replacement is n4 (its NVLink domain), not n3.
    s, acts = _after_preflight({n: "s1" for n in ("n1", "n2", "n3", "n4")}, {"n1": X, "n3": X, "n2": Y, "n4": Y})
    topo = records(acts, "topology")
    assert len(topo) == 1 and topo[0].data == {"domains": {"n1": X, "n2": Y, "n3": X, "n4": Y},
                                               "source": "nvml_fabric"}
    assert only(acts, Launch)[0].nodes == ("n1", "n2")
    acts = lose(s, "n2", 1010.0)
    assert only(acts, Launch)[0].nodes == ("n1", "n4") and not records(acts, "spare_out_of_domain")


def test_a_spare_outside_the_nvlink_domain_only_when_none_is_left_and_the_timeline_says_so():
    s, _ = _after_preflight({}, {"n1": X, "n2": Y, "n3": X, "n4": X})
    acts = lose(s, "n2", 1010.0)
    assert only(acts, Launch)[0].nodes == ("n1", "n3")
    out = records(acts, "spare_out_of_domain")[0].data
    assert (out["node"], out["spare"], out["domain"], out["spare_domain"]) == ("n2", "n3", Y, X)


def test_nodes_that_name_no_fabric_keep_slurms_domain():
    s, acts = _after_preflight({"n1": "a", "n2": "b", "n3": "a", "n4": "b"}, {"n1": X, "n3": X})
    assert records(acts, "topology")[0].data["domains"] == {"n1": X, "n3": X}
    assert s.domains == {"n1": X, "n2": "b", "n3": X, "n4": "b"}
    acts = lose(s, "n2", 1010.0)
    assert only(acts, Launch)[0].nodes == ("n1", "n4") and not records(acts, "spare_out_of_domain")


def test_a_later_check_records_only_the_nodes_whose_domain_it_changes():
    names = ("n1", "n2", "n3", "n4")
    s, _ = _after_preflight({}, {n: X for n in names}, postmortem="preflight")
    for t, fab, want in ((1010.0, {"n1": X, "n4": Y}, [{"n4": Y}]), (1020.0, {"n1": X, "n4": Y}, [])):
        s.handle(CheckpointCommitted(t, 20, "/ck/20"))
        acts = s.handle(StepExited(t + 1, returncode=1))
        assert only(acts, RunPreflight)[0].postmortem
        acts = s.handle(PreflightDone(t + 2, {n: "pass" for n in names}, {}, postmortem=True, fabric=fab))
        assert [r.data["domains"] for r in records(acts, "topology")] == want
    assert s.domains == {"n1": X, "n2": X, "n3": X, "n4": Y}


def test_without_a_preflight_nothing_changes_slurms_domains():
    s = Supervisor(P(nodes=2, spare_nodes=2), ["n1", "n2", "n3", "n4"], domains={"n1": "a", "n2": "b"})
    acts = s.start(1000.0)
    assert not records(acts, "topology") and s.domains == {"n1": "a", "n2": "b"}


# ------------------------------------------------------------------------------ the plumbing
class _Done:
    pid = 2 ** 22 + 7   # above any pid_max: nothing real

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


class _ReportingRunner:
    """``spawn`` of the preflight's srun: each node's report lands in its ``%t`` file."""

    def __init__(self, reports):
        self.reports = reports

    def spawn(self, argv, *, log_path, env=None, cwd=None, unset=()):
        out = next(a.split("=", 1)[1] for a in argv if a.startswith("--output="))
        for i, rep in enumerate(self.reports):
            Path(out.replace("%t", str(i))).write_text(rep)
        Path(log_path).write_text("")
        return _Done()


class _Topology:
    def topology(self):
        return {"n1": "s1", "n2": "s1", "n9": "s9"}


def test_the_plumbing_reads_each_nodes_domain_and_records_slurms_with_its_source(tmp_path):
    nvl = [x.to_dict() for x in probe(doc(NVL72)).values()]
    h100 = [x.to_dict() for x in probe(doc("h100_sxm_8gpu_idle.json")).values()]
    reports = [json.dumps({"node": "n1", "status": "pass", "results": nvl}),
               json.dumps({"node": "n2", "status": "pass", "results": h100}),
               json.dumps({"node": "n7", "status": "pass", "results": nvl}),   # not asked: ignored
               "not json"]
    cfg = plumbing.RunConfig(command=["python", "train.py"], job_dir=tmp_path / "job", ckpt_dir=tmp_path / "ck",
                             policy=sv.Policy(nodes=2), nodes=["n1", "n2", "n3"], job_id="7", python="python3")
    (tmp_path / "job").mkdir()
    run = plumbing.SupervisorRun(cfg, slurm=_Topology(), runner=_ReportingRunner(reports), clock=lambda: 5.0,
                                 echo=lambda _: None)
    assert run._domains() == {"n1": "s1", "n2": "s1"}
    run._act_run_preflight(RunPreflight(("n1", "n2", "n3"), "preflight", 60.0))
    ev = run._poll_preflight(5.0)
    assert ev.fabric == {"n1": DOMAIN} and ev.statuses == {"n1": "pass", "n2": "pass", "n3": "missing"}
    topo = [json.loads(line) for line in (tmp_path / "job" / "timeline.jsonl").read_text().splitlines()]
    topo = [r for r in topo if r["event"] == "topology"]
    assert [(r["domains"], r["source"]) for r in topo] == [({"n1": "s1", "n2": "s1"}, "slurm")]
