"""Parsers on outputs recorded from the real dev cluster (22.05) and on the 23.02+ shapes."""

from pathlib import Path

import pytest

from clusterops.slurm import parse
from clusterops.slurm.states import DONE, FAILED, JOB_STATES, PENDING, RUNNING, categorize

FIX = Path(__file__).parent / "fixtures" / "slurm"


def by_name(jobs):
    return {j.name: j for j in jobs}


@pytest.mark.parametrize("loader", [
    lambda: parse.parse_squeue_json((FIX / "squeue_2205.json").read_text()),
    lambda: parse.parse_squeue_json((FIX / "squeue_2311.json").read_text()),
    lambda: parse.parse_scontrol_jobs((FIX / "scontrol_jobs_2205.txt").read_text()),
], ids=["squeue-22.05", "squeue-23.11", "scontrol-oneliner"])
def test_jobs_parse_to_the_same_facts(loader):
    jobs = by_name(loader())
    assert jobs["ok"].state == "COMPLETED" and jobs["ok"].category == DONE and jobs["ok"].exit_code == 0
    assert jobs["bad"].state == "FAILED" and jobs["bad"].category == FAILED
    assert jobs["bad"].exit_code == 3 and jobs["bad"].reason == "NonZeroExitCode"
    train = jobs["train"]
    assert train.state == "RUNNING" and train.category == RUNNING
    assert train.node_names == ("node1", "node2") and train.batch_host == "node1"
    assert train.time_limit_min == 30
    assert train.start_time and train.start_time > 1.7e9
    held = jobs["held"]
    assert held.category == PENDING and held.reason == "JobHeldUser" and held.node_names == ()
    assert held.start_time is None or held.start_time > 0


def test_2311_shapes_specific():
    jobs = by_name(parse.parse_squeue_json((FIX / "squeue_2311.json").read_text()))
    assert jobs["held"].time_limit_min is None          # infinite
    assert jobs["train"].restart_count == 2 and jobs["train"].excluded_nodes == "node3"
    pre = jobs["preempted"]
    assert pre.state == "PREEMPTED" and pre.state_flags == ("REQUEUED",)
    assert pre.category == PENDING                        # ended, but on its way back
    assert pre.exit_signal == 15
    assert jobs["ok"].array_task_id is None


def test_2205_exit_code_is_a_wait_status():
    assert parse._exit_code(768) == (3, None)
    assert parse._exit_code(9) == (0, 9)
    assert parse._exit_code("3:0") == (3, None)
    assert parse._exit_code("0:15") == (0, 15)


@pytest.mark.parametrize("loader", [
    lambda: parse.parse_sinfo_json((FIX / "sinfo_2205.json").read_text()),
    lambda: parse.parse_sinfo_json((FIX / "nodes_2311.json").read_text()),
    lambda: parse.parse_scontrol_nodes((FIX / "scontrol_nodes_2205.txt").read_text()),
], ids=["sinfo-22.05", "nodes-23.11", "scontrol-oneliner"])
def test_nodes_parse_to_the_same_facts(loader):
    nodes = {n.name: n for n in loader()}
    assert set(nodes) == {"node1", "node2", "node3", "node4"}
    assert nodes["node1"].state == "mixed" and nodes["node1"].busy and not nodes["node1"].drained
    n3 = nodes["node3"]
    assert n3.state == "idle" and n3.drained and not n3.is_idle
    assert n3.reason == "admin: replace fan" and n3.reason_user == "root" and n3.reason_time > 1.7e9
    n4 = nodes["node4"]
    assert n4.is_down and not n4.responding and "NOT_RESPONDING" in n4.flags
    assert nodes["node2"].gres == "gpu:4" and nodes["node2"].partitions == ("debug", "urgent")
    assert nodes["node2"].cpus == 2


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
    assert parse.parse_version((FIX / "sinfo_version_2205.txt").read_text()) == (22, 5, 8)
    assert parse.parse_version("slurm 23.11.4") == (23, 11, 4)
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
    jobs = by_name(parse.parse_scontrol_jobs((FIX / "scontrol_jobs_2205.txt").read_text()))
    assert jobs["train"].preempt_time is None        # PreemptTime=None: never preempted


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
    as_json = {"name": "node2", "state": ["IDLE"], "reason": "old", "reason_set_by_user": "root",
               "reason_changed_at": {"set": True, "infinite": False, "number": 1796049600}}
    assert parse.node_from_json(as_json).reason is None
    assert parse.node_from_json({**as_json, "state": ["IDLE", "DRAIN"]}).reason == "old"


def test_controller_version_from_show_config():
    text = "Configuration data as of 2026-12-01T05:00:00\nAccountingStorageType   = (null)\nSLURM_VERSION           = 25.11.7\n"
    assert parse.parse_config_version(text) == (25, 11, 7)
    with pytest.raises(ValueError):
        parse.parse_config_version("nothing here")
