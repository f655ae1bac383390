"""Parsers on outputs recorded from real dev clusters, one directory per Slurm version
(tests/fixtures/slurm/<major.minor>/, written by record.py), plus a few shapes no dev
cluster produces (inline). Every recorded version must parse to the same facts."""

import json
import re
from pathlib import Path

import pytest

from clusterops.errors import NotFoundError
from clusterops.slurm import Slurm, parse
from clusterops.slurm.states import DONE, FAILED, JOB_STATES, PENDING, RUNNING, categorize
from clusterops.slurm.parse import parse_srun_failures
from support.fakes import ScriptedRunner, replay

FIX = Path(__file__).parent / "fixtures" / "slurm"
VERSIONS = sorted(p.name for p in FIX.iterdir() if p.is_dir() and re.fullmatch(r"\d+\.\d+", p.name))


class Recorded:
    """One version directory: its files and the scenario it was recorded with."""

    def __init__(self, name: str):
        self.dir = FIX / name
        self.scenario = json.loads(self.read("scenario.json"))
        self.version = tuple(self.scenario["version"])
        self.ids = self.scenario["jobs"]

    def read(self, name: str) -> str:
        return (self.dir / name).read_text()

    def has(self, name: str) -> bool:
        return (self.dir / name).exists()


@pytest.fixture(params=VERSIONS)
def rec(request):
    return Recorded(request.param)


def test_at_least_two_slurm_versions_are_recorded():
    # The oldest supported shape (22.05, openapi v0.0.38) and one data_parser shape (23.02+).
    assert len(VERSIONS) >= 2
    versions = [Recorded(v).version for v in VERSIONS]
    assert min(versions) < (23, 2) <= max(versions)


def test_directory_matches_the_recorded_version(rec):
    assert rec.dir.name == f"{rec.version[0]}.{rec.version[1]:02d}"
    assert parse.parse_version(rec.read("version.txt")) == rec.version
    assert parse.parse_config_version(rec.read("config_version.txt")) == rec.version


def by_name(jobs):
    return {j.name: j for j in jobs}


JOB_SOURCES = {
    "squeue.json": parse.parse_squeue_json,
    "scontrol_jobs.txt": parse.parse_scontrol_jobs,
}


@pytest.mark.parametrize("source", sorted(JOB_SOURCES))
def test_jobs_parse_to_the_same_facts(rec, source):
    jobs = by_name(JOB_SOURCES[source](rec.read(source)))
    assert {j.job_id for j in jobs.values()} >= set(rec.ids.values())
    ok, bad = jobs["ok"], jobs["bad"]
    assert ok.job_id == rec.ids["ok"] and ok.state == "COMPLETED" and ok.category == DONE and ok.exit_code == 0
    assert bad.state == "FAILED" and bad.category == FAILED
    assert bad.exit_code == 3 and bad.exit_signal is None and bad.reason == "NonZeroExitCode"
    train = jobs["train"]
    assert train.state == "RUNNING" and train.category == RUNNING
    assert train.node_names == ("node1", "node2") and train.batch_host == "node1"
    assert train.time_limit_min == 30 and train.partition == "debug"
    assert train.start_time and train.start_time > 1.7e9 and train.submit_time <= train.start_time
    assert train.preempt_time is None and train.array_job_id is None and train.array_task_id is None
    held = jobs["held"]
    assert held.category == PENDING and held.reason == "JobHeldUser" and held.node_names == ()
    requeued = jobs["requeued"]
    assert requeued.category == PENDING and requeued.restart_count == 1 and requeued.requeue
    # The killed srun (rank 2 got SIGKILL, the rest SIGTERM) and the cancelled node-loss job.
    assert jobs["nodefail"].state == "CANCELLED" and jobs["nodefail"].exit_signal == 15


def test_json_shape_follows_the_version(rec):
    # 22.05 (openapi v0.0.38) prints states as strings and exit codes as wait statuses;
    # 23.02+ (data_parser) prints state lists and {set, infinite, number} objects.
    raw = {j["name"]: j for j in json.loads(rec.read("squeue.json"))["jobs"]}
    if rec.version >= (23, 2):
        assert raw["train"]["job_state"] == ["RUNNING"]
        assert raw["train"]["time_limit"] == {"set": True, "infinite": False, "number": 30}
        assert isinstance(raw["bad"]["exit_code"], dict)
    else:
        assert raw["train"]["job_state"] == "RUNNING" and raw["bad"]["exit_code"] == 3 << 8
    # Either way the layer reads the same JobInfo.
    assert parse.job_from_json(raw["bad"]).exit_code == 3


def test_finished_jobs_are_in_the_squeue_json(rec):
    # The client asks `squeue --json --states=all`; the recording is that command's output.
    states = {j.name: j.state for j in parse.parse_squeue_json(rec.read("squeue.json"))}
    assert states["ok"] == "COMPLETED" and states["bad"] == "FAILED"


def node_sources(rec):
    out = {"scontrol_nodes.txt": parse.parse_scontrol_nodes(rec.read("scontrol_nodes.txt")),
           "sinfo.json": parse.parse_sinfo_json(rec.read("sinfo.json"))}
    if rec.has("nodes.json"):
        out["nodes.json"] = parse.parse_sinfo_json(rec.read("nodes.json"))
    return out


def test_nodes_parse_to_the_same_facts(rec):
    sources = node_sources(rec)
    assert ("nodes.json" in sources) == (rec.version >= (23, 2))   # scontrol --json came with 23.02
    for source, found in sources.items():
        nodes = {n.name: n for n in found}
        assert set(nodes) == {"node1", "node2", "node3", "node4"}, source
        n1 = nodes["node1"]
        assert n1.state == "mixed" and n1.busy and not n1.drained and n1.reason is None, source
        n2 = nodes["node2"]
        # node2 was drained and resumed: 24.11+ keep the old reason, the layer must not show it.
        assert n2.state == "mixed" and not n2.drained and n2.reason is None, source
        assert n2.gres == "gpu:4" and n2.partitions == ("debug", "urgent") and n2.cpus == 2, source
        n3 = nodes["node3"]
        assert n3.state == "idle" and n3.drained and not n3.is_idle, source
        assert n3.reason == "admin: replace fan" and n3.reason_user == "root" and n3.reason_time > 1.7e9, source
        n4 = nodes["node4"]
        assert n4.is_down and not n4.responding and "NOT_RESPONDING" in n4.flags, source
        assert n4.reason == "Not responding", source


def test_resumed_node_right_after_resume(rec):
    n = parse.node_from_oneliner(rec.read("scontrol_node_resumed.txt").strip())
    # Just after State=RESUME the node waits to re-register (NOT_RESPONDING), is not drained,
    # and (24.11+) still carries the old reason, which the layer does not show.
    assert n.name == "node2" and not n.drained and not n.is_idle and n.reason is None
    assert n.state == "mixed" and "NOT_RESPONDING" in n.flags
    raw = rec.read("scontrol_node_resumed.txt")
    assert ("Reason=clusterops:test: stale reason" in raw) == (rec.version >= (24, 11))


def test_steps_node_states_partition_and_sbatch(rec):
    steps = parse.parse_steps(rec.read("squeue_steps.txt"))
    assert ("0", "train-step") in steps
    states = parse.parse_sinfo_node_states(rec.read("sinfo_node_states.txt"))
    assert states == {"node1": "mixed", "node2": "mixed", "node3": "drained", "node4": "down*"}
    assert parse.parse_hostlist_lines(rec.read("sinfo_partition_nodes.txt")) == ["node1", "node2", "node3", "node4"]
    assert parse.parse_sbatch_parsable(rec.read("sbatch_parsable.txt")) == rec.ids["ok"]


def test_srun_errors(rec):
    failures, lost = parse_srun_failures(rec.read("srun_killed.txt"))
    assert (failures[0].node, failures[0].rank, failures[0].reason) == ("node3", 2, "Killed")
    assert {(f.node, f.rank, f.reason) for f in failures[1:]} == {("node1", 0, "Terminated"), ("node2", 1, "Terminated")}
    assert lost == []
    failures, lost = parse_srun_failures(rec.read("srun_exit.txt"))
    assert sorted(f.rank for f in failures) == [0, 1, 2, 3]
    assert {f.reason for f in failures} == {"Exited with exit code 1"}
    failures, lost = parse_srun_failures(rec.read("srun_nodefail.txt"))
    assert lost == ["node4"] and ("node4", 1, "Killed") in {(f.node, f.rank, f.reason) for f in failures}


def test_recorded_not_found_errors_are_not_found(rec, monkeypatch):
    errors = json.loads(rec.read("errors.json"))
    monkeypatch.delenv("SLURM_CONF", raising=False)

    def client(cmd):
        return Slurm(ScriptedRunner(answer=replay(errors[cmd])), read_attempts=1, sleep=lambda s: None)

    with pytest.raises(NotFoundError):
        client("scontrol show job 999999").job(999999)
    with pytest.raises(NotFoundError):
        client("scontrol show node nosuchnode").nodes("nosuchnode")
    # squeue and scontrol both say "Invalid job id": jobs() leaves the id out, no error.
    assert client("squeue --noheader --jobs=999999").jobs([999999]) == []
    with pytest.raises(NotFoundError):
        client("sinfo --noheader --partition=nosuch").partition_nodes("nosuch")
    with pytest.raises(NotFoundError):
        client("sbatch --parsable --partition=nosuch --wrap=true").submit(text="#!/bin/sh\ntrue\n")


def test_list_state_flags_fold():
    # Shapes no dev cluster recording holds: a preempted job on its way back (23.02+ flags).
    pre = parse.job_from_json({"job_id": 9, "name": "p", "job_state": ["PREEMPTED", "REQUEUED"],
                               "exit_code": {"status": ["SIGNALED"], "return_code": {"set": False, "infinite": False, "number": 0},
                                             "signal": {"id": {"set": True, "infinite": False, "number": 15}, "name": "TERM"}},
                               "time_limit": {"set": False, "infinite": True, "number": 0},
                               "array_task_id": {"set": True, "infinite": False, "number": 3},
                               "array_job_id": {"set": True, "infinite": False, "number": 8}})
    assert pre.state == "PREEMPTED" and pre.state_flags == ("REQUEUED",) and pre.category == PENDING
    assert pre.exit_signal == 15 and pre.exit_code is None and pre.time_limit_min is None
    assert pre.array_job_id == 8 and pre.array_task_id == 3


def test_2205_exit_code_is_a_wait_status():
    assert parse._exit_code(768) == (3, None)
    assert parse._exit_code(9) == (0, 9)
    assert parse._exit_code("3:0") == (3, None)
    assert parse._exit_code("0:15") == (0, 15)


def test_oneliner_keeps_spaces_and_odd_keys():
    kv = parse.parse_oneliner("JobId=7 JobName=my job Reason=None AllocNode:Sid=vm:12 CPUs/Task=1 Command=/a b/c.sh")
    assert kv["JobName"] == "my job" and kv["AllocNode:Sid"] == "vm:12" and kv["CPUs/Task"] == "1"
    assert kv["Command"] == "/a b/c.sh"


@pytest.mark.parametrize("text,minutes", [
    ("UNLIMITED", None), ("30", 30), ("1:30", 1.5), ("01:00:00", 60), ("2-00:00:00", 2880),
    ("1-2", 1560), ("1-02:30", 1590), ("0:01:30", 1.5),
])
def test_time_limits(text, minutes):
    assert parse.parse_time_limit(text) == minutes


def test_version_and_sbatch():
    assert parse.parse_version("slurm 22.05.8") == (22, 5, 8)
    assert parse.parse_version("slurm-wlm 24.11.5") == (24, 11, 5)
    assert parse.parse_sbatch_parsable("123\n") == 123
    assert parse.parse_sbatch_parsable("456;cluster-a") == 456
    with pytest.raises(ValueError):
        parse.parse_sbatch_parsable("sbatch: error: Batch job submission failed")


def test_number_objects():
    assert parse.number({"set": True, "infinite": False, "number": 5}) == 5
    assert parse.number({"set": False, "infinite": False, "number": 5}) is None
    assert parse.number({"set": True, "infinite": True, "number": 0}) is None
    assert parse.epoch(0) is None and parse.epoch(1796049600) == 1796049600.0


@pytest.mark.parametrize("state,category", [
    ("PENDING", PENDING), ("RUNNING", RUNNING), ("COMPLETED", DONE), ("CANCELLED by 0", FAILED),
    ("REQUEUED", PENDING), ("PREEMPTED", FAILED), ("NODE_FAIL", FAILED), ("BOOT_FAIL", FAILED),
    ("DEADLINE", FAILED), ("OUT_OF_MEMORY", FAILED), ("TIMEOUT", FAILED), ("COMPLETING", RUNNING),
    ("SUSPENDED", RUNNING), ("REQUEUE_HOLD", PENDING), ("SPECIAL_EXIT", PENDING),
    (["PENDING", "REQUEUED"], PENDING), (["RUNNING", "COMPLETING"], RUNNING),
    (["NODE_FAIL", "REQUEUED"], PENDING), (["COMPLETED"], DONE), ("SOMETHING_NEW", FAILED), (None, FAILED),
])
def test_state_table(state, category):
    assert categorize(state) == category


def test_state_table_covers_slurm_base_states():
    for s in ("PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
              "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REQUEUED"):
        assert s in JOB_STATES
    assert set(JOB_STATES.values()) == {PENDING, RUNNING, DONE, FAILED}


def test_steps_and_preempt_time():
    text = "12.0 train\n12.batch batch\n12.extern extern\n13.1 preflight\n"
    assert parse.parse_steps(text) == [("0", "train"), ("batch", "batch"), ("extern", "extern"), ("1", "preflight")]
    line = ("JobId=5 JobName=t JobState=PENDING Reason=None Restarts=1 ExitCode=0:15 "
            "PreemptTime=2026-11-30T14:35:36 NodeList=(null)")
    job = parse.job_from_oneliner(line)
    assert job.preempt_time is not None and job.preempt_time > 1.7e9 and job.exit_signal == 15


def test_stale_reason_on_a_node_back_in_service_is_dropped():
    # Slurm 24.11 keeps the drain reason on a node resumed with State=RESUME.
    resumed = ("NodeName=node2 Arch=x86_64 CPUTot=2 CPUAlloc=0 State=IDLE Partitions=debug "
               "Reason=clusterops:health:fast: gpu: lost [root@2026-12-01T05:00:00]")
    n = parse.node_from_oneliner(resumed)
    assert n.is_idle and not n.drained and n.reason is None and n.reason_user is None
    drained = resumed.replace("State=IDLE", "State=IDLE+DRAIN")
    n = parse.node_from_oneliner(drained)
    assert n.drained and n.reason == "clusterops:health:fast: gpu: lost" and n.reason_user == "root"
    down = resumed.replace("State=IDLE", "State=DOWN+NOT_RESPONDING")
    assert parse.node_from_oneliner(down).reason == "clusterops:health:fast: gpu: lost"
    rejoining = resumed.replace("State=IDLE", "State=IDLE+NOT_RESPONDING")   # resumed, not re-registered yet
    assert parse.node_from_oneliner(rejoining).reason is None
    as_json = {"name": "node2", "state": ["IDLE"], "reason": "old", "reason_set_by_user": "root",
               "reason_changed_at": {"set": True, "infinite": False, "number": 1796049600}}
    assert parse.node_from_json(as_json).reason is None
    assert parse.node_from_json({**as_json, "state": ["IDLE", "DRAIN"]}).reason == "old"


def test_controller_version_from_show_config():
    text = "Configuration data as of 2026-12-01T05:00:00\nAccountingStorageType   = (null)\nSLURM_VERSION           = 25.11.7\n"
    assert parse.parse_config_version(text) == (25, 11, 7)
    with pytest.raises(ValueError):
        parse.parse_config_version("nothing here")


# Recorded from the dev cluster (srun 22.05): rank 2 SIGKILLed, the others torn down.
SRUN_KILLED = """\
0: step 1
srun: error: node3: task 2: Killed
srun: launch/slurm: _step_signal: Terminating StepId=5.0
slurmstepd-node1: error: *** STEP 5.0 ON node1 CANCELLED AT 2026-11-30T14:44:38 ***
srun: error: node1: task 0: Terminated
srun: error: node2: task 1: Terminated
srun: Force Terminated StepId=5.0
"""
SRUN_NODE_FAIL = """\
srun: error: Node failure on node3
srun: error: node1: tasks 0-1: Exited with exit code 1
"""


def test_parse_srun_failures_keeps_order_and_ranks():
    failures, lost = parse_srun_failures(SRUN_KILLED)
    assert [(f.node, f.rank, f.reason) for f in failures] == [
        ("node3", 2, "Killed"), ("node1", 0, "Terminated"), ("node2", 1, "Terminated")]
    assert lost == []
    failures, lost = parse_srun_failures(SRUN_NODE_FAIL)
    assert lost == ["node3"]
    assert [f.rank for f in failures] == [0, 1] and failures[0].reason == "Exited with exit code 1"


# -- a node's Reason is the rest of the line ------------------------------------------------------
# Administrators write reasons as free text; scontrol prints Reason as the last field of a
# node's line in every recorded version. Nothing inside it may be read as another field.

def hostile_sources():
    return [v for v in VERSIONS if (FIX / v / "scontrol_nodes_hostile_reasons.txt").exists()]


def test_hostile_reasons_are_recorded_for_every_version():
    assert hostile_sources() == VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
def test_reason_with_key_text_overrides_nothing(version):
    """``scontrol_nodes_hostile_reasons.txt``: reasons that read like fields (``State=IDLE``,
    ``Reason=clusterops:...``, ``NodeName=node9``) stay the administrator's, whole."""
    rec = Recorded(version)
    meta = json.loads(rec.read("hostile_reasons.json"))
    nodes = {n.name: n for n in parse.parse_scontrol_nodes(rec.read("scontrol_nodes_hostile_reasons.txt"))}
    assert set(nodes) == set(meta), version
    for name, want in meta.items():
        n = nodes[name]
        assert n.reason == want, (version, name, n.reason)
        assert n.drained and n.reason_user == "root" and n.reason_time and n.reason_time > 1.7e9, (version, name)
        assert n.partitions == ("debug", "urgent") and n.gres == "gpu:4", (version, name)
    from clusterops import drains

    # An administrator's reason that embeds ours is still the administrator's: never resumed.
    assert all(drains.is_foreign(n.reason) for n in nodes.values()), version


def test_inline_reason_cannot_rename_or_undrain_a_node():
    line = ("NodeName=gpu7 Arch=x86_64 CPUTot=8 CPUAlloc=0 Gres=gpu:8 State=IDLE+DRAIN Partitions=gpu "
            "Reason=swap DIMM NodeName=gpu1 State=IDLE Partitions=other Reason=clusterops:sweep: x "
            "[bob@2026-01-02T03:04:05] [root@2026-12-01T05:09:21]")
    n = parse.node_from_oneliner(line)
    assert (n.name, n.state, n.drained, n.partitions, n.cpus) == ("gpu7", "idle", True, ("gpu",), 8)
    assert n.reason == ("swap DIMM NodeName=gpu1 State=IDLE Partitions=other Reason=clusterops:sweep: x "
                        "[bob@2026-01-02T03:04:05]")
    assert n.reason_user == "root"
    # A job's Reason is Slurm's one word in the middle of the line, not the rest of it.
    kv = parse.parse_oneliner("JobId=7 JobState=PENDING Reason=Priority Dependency=(null)")
    assert kv["Reason"] == "Priority" and kv["Dependency"] == "(null)"


def test_pyslurm_backend_keeps_the_reason_it_reads():
    from types import SimpleNamespace

    from clusterops.slurm.pyslurm_backend import PyslurmSlurm

    reason = 'State=IDLE Reason=clusterops:sweep: x "quoted" ünïcode'
    obj = SimpleNamespace(name="node1", state="IDLE+DRAIN", reason=reason, reason_user="root",
                          reason_time=1.8e9, configured_gres={"gpu": 4}, partitions=["debug"],
                          total_cpus=2, allocated_cpus=0)
    n = PyslurmSlurm._node_info(None, obj)
    assert n.reason == reason and n.drained and n.state == "idle" and n.reason_time == 1.8e9


def test_comment_and_extra_after_the_reason_stay_out_of_it():
    """Recorded: a node's Comment= and Extra= are printed after the reason's stamp, and here
    they read like fields and like a stamp themselves."""
    found = [v for v in VERSIONS if (FIX / v / "scontrol_node_comment_after_reason.txt").exists()]
    assert found
    for v in found:
        raw = (FIX / v / "scontrol_node_comment_after_reason.txt").read_text()
        assert raw.index(" Reason=") < raw.index(" Comment=") < raw.index(" Extra="), v
        n = parse.parse_scontrol_nodes(raw)[0]
        assert (n.name, n.state, n.drained) == ("node1", "idle", True), v
        assert n.reason == "clusterops:sweep: host.paths: /scratch missing" and n.reason_user == "root", v
        assert n.reason_time and n.reason_time > 1.79e9, v      # the real stamp, not the comment's
