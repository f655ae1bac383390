"""Rendered launch scripts on the real dev cluster: real sbatch, srun, torchrun, gloo.

Each job runs examples/dist_check.py (or a small chain script) and the tests read what
every rank saw. The dev nodes have 2 CPUs each, so one rank per node for the
launchers; the venv is activated through the spec's `setup` (path from sys.prefix).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clusterops import launch

REPO = Path(__file__).resolve().parents[2]
DIST_CHECK = REPO / "examples" / "dist_check.py"
ACTIVATE = Path(sys.prefix) / "bin" / "activate"

pytestmark = pytest.mark.integration


def slurm_client():
    from clusterops.slurm import Slurm

    return Slurm.from_environment()


def wait_done(slurm, job_id: int, timeout_s: float, log_dir: Path):
    deadline = time.monotonic() + timeout_s
    while True:
        tasks = slurm.job_tasks(job_id)
        if tasks and all(t.category in ("done", "failed") for t in tasks):
            return tasks
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(log_dir.glob("*.out")))
            raise AssertionError(f"job {job_id} not done after {timeout_s}s: "
                                 f"{[(t.job_id, t.state) for t in tasks]}\n{logs}")
        time.sleep(0.5)


def write_spec(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def base_spec(launcher: str, nodes: int, out: Path, extra: str = "") -> str:
    return textwrap.dedent(f"""
        name: dist-{launcher}
        launcher: {launcher}
        nodes: {nodes}
        nproc_per_node: 1
        time: "0:05:00"
        script: {json.dumps(str(DIST_CHECK))}
        args: [--out, {json.dumps(str(out))}]
        env:
          OMP_NUM_THREADS: "1"
        setup:
          - source {json.dumps(str(ACTIVATE))}
    """).lstrip() + textwrap.dedent(extra)


def read_ranks(out: Path):
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


def check_ranks(ranks, world_size: int, nodes: int, procs_per_node: int):
    assert [r["rank"] for r in ranks] == list(range(world_size))
    assert {r["world_size"] for r in ranks} == {world_size}
    assert all(r["ok"] and r["allreduce"] == [float(world_size)] * 4 for r in ranks)
    assert len({(r["master_addr"], r["master_port"]) for r in ranks}) == 1
    assert ranks[0]["master_addr"] and ranks[0]["master_port"]
    # Every rank saw the same rendezvous as every other one.
    for r in ranks:
        assert {(p["master_addr"], p["master_port"]) for p in r["peers"]} == {
            (ranks[0]["master_addr"], ranks[0]["master_port"])}
    by_node = {}
    for r in ranks:
        by_node.setdefault(r["slurmd_nodename"], []).append(r)
    assert len(by_node) == nodes
    for node_ranks in by_node.values():
        assert sorted(r["local_rank"] for r in node_ranks) == list(range(procs_per_node))
    # Rank 0 sits on the first node of the allocation (it hosts the rendezvous).
    assert ranks[0]["slurmd_nodename"] == sorted(by_node)[0]


@pytest.mark.timeout(300)
def test_torchrun_4_nodes_via_cli(cluster, tmp_path, capsys):
    from clusterops.cli import main

    # The example spec itself, with its output, logs and venv moved for the test.
    out = tmp_path / "out"
    spec = REPO / "examples" / "torchrun.yaml"
    with pytest.raises(SystemExit) as exc:
        main(["launch", "submit", str(spec), "--json", "--set", f"args=[--out, {json.dumps(str(out))}]",
              "--set", f"log_dir={json.dumps(str(tmp_path / 'logs'))}",
              "--set", f"setup=[source {json.dumps(str(ACTIVATE))}]"])
    printed, err = capsys.readouterr()
    assert exc.value.code == 0, err
    result = json.loads(printed)
    assert Path(result["script_path"]).parent == tmp_path / "logs"
    tasks = wait_done(slurm_client(), result["job_id"], 280, tmp_path / "logs")
    assert tasks[0].state == "COMPLETED", tasks
    check_ranks(read_ranks(out), world_size=4, nodes=4, procs_per_node=1)
    # One batch log and one log per node.
    node_logs = sorted((tmp_path / "logs").glob(f"dist-check-torchrun-{result['job_id']}-*-*.out"))
    assert len(node_logs) == 4
    assert all("allreduce [4.0, 4.0, 4.0, 4.0] OK" in p.read_text() for p in node_logs)


@pytest.mark.timeout(300)
def test_srun_launcher_one_task_per_rank(cluster, tmp_path):
    out = tmp_path / "out"
    spec = launch.load_spec(write_spec(tmp_path, base_spec("srun", 2, out, "python: python\n")),
                            ["nproc_per_node=2"])
    result = launch.submit(spec, slurm_client())
    tasks = wait_done(slurm_client(), result.job_id, 280, tmp_path / "logs")
    assert tasks[0].state == "COMPLETED", tasks
    ranks = read_ranks(out)
    check_ranks(ranks, world_size=4, nodes=2, procs_per_node=2)
    assert [r["slurm_procid"] for r in ranks] == ["0", "1", "2", "3"]


@pytest.mark.timeout(300)
def test_accelerate_2_nodes(cluster, tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")
    out = tmp_path / "out"
    spec = launch.load_spec(write_spec(tmp_path, base_spec(
        "accelerate", 2, out, "launcher_args: [--mixed_precision=no, --dynamo_backend=no]\n")))
    result = launch.submit(spec, slurm_client())
    tasks = wait_done(slurm_client(), result.job_id, 280, tmp_path / "logs")
    assert tasks[0].state == "COMPLETED", tasks
    check_ranks(read_ranks(out), world_size=2, nodes=2, procs_per_node=1)


@pytest.mark.timeout(300)
def test_lead_time_signal_reaches_the_training_processes(cluster, tmp_path):
    """A 3-minute job with a 90 s lead: SIGUSR1 reaches every rank under torchrun before the limit.

    Slurm may send the signal up to 60 s early (sbatch(1)), i.e. 30 s after the start
    here: late enough for the ranks to be up and to have installed their handler, even
    on a busy machine. (A signal that comes before the ranks exist reaches nobody.)
    """
    out = tmp_path / "out"
    spec = launch.load_spec(write_spec(tmp_path, base_spec("torchrun", 2, out)),
                            ["time=0:03:00", "signal_lead_s=90",
                             f"args=[--out, {json.dumps(str(out))}, --hold-s, 175]"])
    assert spec.signal_lead_s == 90
    slurm = slurm_client()
    result = launch.submit(spec, slurm)
    tasks = wait_done(slurm, result.job_id, 260, tmp_path / "logs")
    info = tasks[0]
    ranks = read_ranks(out)
    # The ranks stop on the signal, so the job completes instead of hitting its limit.
    assert info.state == "COMPLETED", (tasks, ranks)
    assert len(ranks) == 2
    for r in ranks:
        assert [s["signal"] for s in r["signals"]] == ["SIGUSR1"], r  # once, not twice
        assert info.start_time <= r["signals"][0]["time"] < info.start_time + 180
    batch_log = (tmp_path / "logs" / f"dist-torchrun-{result.job_id}.out").read_text()
    assert "SIGUSR1 received; forwarding it to the job step" in batch_log
    assert "job step exited with status 0" in batch_log


CHAIN_SCRIPT = """#!/bin/bash
# One link of a chain: read what the previous link left, add to it.
set -e
out=$1
prev=$(cat "$out/state" 2>/dev/null || echo 0)
echo "start link=$CLUSTEROPS_CHAIN_LINK task=$SLURM_ARRAY_TASK_ID of=$CLUSTEROPS_CHAIN_LENGTH prev=$prev t=$(date +%s.%N)" >> "$out/log"
sleep 1
echo $((prev + 1)) > "$out/state"
echo "end link=$CLUSTEROPS_CHAIN_LINK t=$(date +%s.%N)" >> "$out/log"
"""


@pytest.mark.timeout(180)
def test_chain_of_3_runs_in_order(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "link.sh"
    script.write_text(CHAIN_SCRIPT)
    script.chmod(0o755)
    spec = launch.load_spec(write_spec(tmp_path, f"""
        name: chain
        launcher: srun
        nodes: 1
        time: "0:05:00"
        chain: 3
        script: link.sh
        args: [{json.dumps(str(out))}]
    """))
    slurm = slurm_client()
    result = launch.submit(spec, slurm)
    deadline = time.monotonic() + 150
    while True:
        tasks = [t for t in slurm.job_tasks(result.job_id) if t.array_task_id is not None]
        if len(tasks) == 3 and all(t.category in ("done", "failed") for t in tasks):
            break
        assert time.monotonic() < deadline, f"chain not done: {[(t.array_task_id, t.state) for t in tasks]}"
        time.sleep(0.5)
    assert sorted(t.state for t in tasks) == ["COMPLETED"] * 3
    lines = (out / "log").read_text().split("\n")[:-1]
    starts = [dict(kv.split("=") for kv in ln.split()[1:]) for ln in lines if ln.startswith("start")]
    ends = [dict(kv.split("=") for kv in ln.split()[1:]) for ln in lines if ln.startswith("end")]
    assert [(s["link"], s["task"], s["of"], s["prev"]) for s in starts] == [
        ("1", "1", "3", "0"), ("2", "2", "3", "1"), ("3", "3", "3", "2")]
    # One after the other: each link starts after the previous one ended.
    for k in (1, 2):
        assert float(starts[k]["t"]) >= float(ends[k - 1]["t"])
    assert (out / "state").read_text().strip() == "3"


DUMP_SCRIPT = """import json, os, sys
out = os.environ["DUMP_DIR"]
keys = ["SLURM_JOB_NAME", "HOSTILE_ENV", "RANK", "SLURM_PROCID", "SLURMD_NODENAME", "MASTER_PORT"]
with open(os.path.join(out, "task-" + os.environ["SLURM_PROCID"] + ".json"), "w") as f:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}, f)
"""


@pytest.mark.timeout(180)
def test_hostile_values_on_a_real_cluster(cluster, tmp_path):
    """Names, paths, args and env values full of shell syntax reach the tasks literally."""
    canary = tmp_path / "canary"
    canary.mkdir()
    dump = tmp_path / "dump"
    dump.mkdir()
    weird = tmp_path / "we'ird \"dir\" $(cd $CANARY && touch dir) `cd $CANARY && touch bt`; x & y #z"
    weird.mkdir()
    script = weird / "du mp's $(x).py"
    script.write_text(DUMP_SCRIPT)
    name = "job \"name\" 'x' $(cd $CANARY && touch name) `id` ; #comment"
    args = ["semi; cd $CANARY && touch semi", "$(cd $CANARY && touch subst)", "`cd $CANARY && touch bt2`",
            "new\nline", "'quote' \"dq\" \\ # * ?"]
    hostile_env = "$(cd $CANARY && touch env) `id` ; 'q' \"dq\""
    spec = launch.JobSpec.from_dict({
        "name": name, "nodes": 2, "launcher": "srun", "script": str(script), "python": sys.executable,
        "workdir": str(weird), "time": "0:05:00", "args": args,
        "env": {"HOSTILE_ENV": hostile_env, "CANARY": str(canary), "DUMP_DIR": str(dump)},
        "sbatch_args": ['--comment=a "b" #c $(d)'],
    })
    result = launch.submit(spec, slurm_client())
    tasks = wait_done(slurm_client(), result.job_id, 120, weird / "logs")
    assert tasks[0].state == "COMPLETED", tasks
    assert list(canary.iterdir()) == []
    recs = [json.loads(p.read_text()) for p in sorted(dump.glob("task-*.json"))]
    assert len(recs) == 2
    for rec in recs:
        assert rec["argv"] == [str(script), *args]
        assert rec["cwd"] == str(weird)
        assert rec["env"]["SLURM_JOB_NAME"] == name  # sbatch's #SBATCH parser got the quoting
        assert rec["env"]["HOSTILE_ENV"] == hostile_env
    assert {r["env"]["SLURMD_NODENAME"] for r in recs} == {"node1", "node2"}
    assert (weird / "logs" / f"{name}-{result.job_id}.out").exists()


@pytest.mark.timeout(60)
def test_bad_spec_submits_nothing(cluster, tmp_path, capsys):
    from clusterops.cli import main

    spec = write_spec(tmp_path, base_spec("torchrun", 4, tmp_path / "out"))
    before = {j.job_id for j in slurm_client().jobs()}
    for override, needle in (("nodes=0", "nodes: must be an integer"), ("time=25:99", "time:"),
                             ("launcher=torchrunn", "did you mean 'torchrun'"),
                             (f"script={tmp_path / 'missing.py'}", "no such file")):
        with pytest.raises(SystemExit) as exc:
            main(["launch", "submit", str(spec), "--set", override])
        _, err = capsys.readouterr()
        assert exc.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert {j.job_id for j in slurm_client().jobs()} == before  # nothing submitted
    assert not (tmp_path / "logs").exists()


FAIL_SCRIPT = """#!/bin/bash
# Rank 1 fails at once; the others would run for a minute.
if [ "$RANK" = 1 ]; then exit 3; fi
sleep 60
"""


@pytest.mark.timeout(120)
def test_one_failed_rank_ends_the_job(cluster, tmp_path):
    """srun --kill-on-bad-exit=1: the job ends with the failure, not when the others finish."""
    script = tmp_path / "fail.sh"
    script.write_text(FAIL_SCRIPT)
    script.chmod(0o755)
    spec = launch.load_spec(write_spec(tmp_path, """
        name: fail-fast
        launcher: srun
        nodes: 4
        time: "0:05:00"
        script: fail.sh
    """))
    slurm = slurm_client()
    result = launch.submit(spec, slurm)
    tasks = wait_done(slurm, result.job_id, 100, tmp_path / "logs")
    # Far less than the 60 s the other ranks sleep (Slurm's times are whole seconds).
    assert tasks[0].end_time - tasks[0].start_time < 45, tasks
    assert tasks[0].state == "FAILED" and tasks[0].exit_code != 0, tasks
    log = (tmp_path / "logs" / f"fail-fast-{result.job_id}.out").read_text()
    assert "task 1: Exited with exit code 3" in log  # srun's report of the failed rank
    # The others were killed (srun exits with the highest status, here theirs), and the
    # batch script ends with srun's status.
    assert f"job step exited with status {tasks[0].exit_code}" in log


STANDIN_SUPERVISOR = """#!{python}
import json, os, sys
with open("/proc/self/stat") as f:
    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
with open(f"/proc/{{ppid}}/comm") as f:
    parent = f.read().strip()
out = {{"argv": sys.argv[1:], "parent": parent, "nodes": os.environ.get("SLURM_JOB_NUM_NODES"),
       "stepd_pid": os.environ.get("SLURM_TASK_PID")}}
with open(os.environ["DUMP_FILE"], "w") as f:
    json.dump(out, f)
"""


@pytest.mark.timeout(120)
def test_supervised_spec_execs_the_supervisor(cluster, tmp_path):
    """With supervise: the batch script allocates the spares and execs `clusterops supervise`."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "clusterops").write_text(STANDIN_SUPERVISOR.format(python=sys.executable))
    (bindir / "clusterops").chmod(0o755)
    dump = tmp_path / "supervisor.json"
    spec = launch.JobSpec.from_dict({
        "name": "supervised", "nodes": 3, "launcher": "torchrun", "script": str(DIST_CHECK),
        "time": "0:05:00", "workdir": str(tmp_path), "env": {"DUMP_FILE": str(dump)},
        "setup": [f"export PATH={bindir}:$PATH"],
        "supervise": {"spare_nodes": 1, "hang_timeout_s": 30, "preflight": False},
    })
    slurm = slurm_client()
    result = launch.submit(spec, slurm)
    tasks = wait_done(slurm, result.job_id, 100, tmp_path / "logs")
    assert tasks[0].state == "COMPLETED", tasks
    assert tasks[0].requeue is True  # the supervisor may requeue the job itself
    seen = json.loads(dump.read_text())
    assert seen["nodes"] == "4"  # 3 + 1 spare
    assert seen["parent"] == "slurmstepd"  # exec'd: the supervisor is the batch step itself
    # The resolved spec is in the 0600 file written with the script, not on the exec line.
    assert seen["argv"] == ["supervise", "--spec-file", result.spec_file]
    assert result.spec_file == result.script_path + launch.SPEC_FILE_SUFFIX
    assert os.stat(result.spec_file).st_mode & 0o777 == 0o600
    assert launch.JobSpec.from_dict(json.loads(Path(result.spec_file).read_text())) == spec


@pytest.mark.timeout(60)
def test_sbatch_refusal_leaves_nothing_behind(cluster, tmp_path, capsys):
    from clusterops.cli import main

    spec = write_spec(tmp_path, base_spec("torchrun", 2, tmp_path / "out"))
    before = {j.job_id for j in slurm_client().jobs()}
    with pytest.raises(SystemExit) as exc:
        main(["launch", "submit", str(spec), "--set", "partition=nosuchpartition"])
    _, err = capsys.readouterr()
    assert exc.value.code == 1, err
    assert len(err.strip().splitlines()) == 1 and "partition" in err.lower(), err
    assert list((tmp_path / "logs").glob("*.sbatch")) == []
    assert {j.job_id for j in slurm_client().jobs()} == before


REQUEUE_SCRIPT = """#!/bin/bash
echo "incarnation ${SLURM_RESTART_COUNT:-0} on $SLURMD_NODENAME"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 120; fi
"""


@pytest.mark.timeout(150)
def test_requeue_keeps_the_logs_of_every_incarnation(cluster, tmp_path):
    """requeue: true lets Slurm requeue the job; the logs are appended to, not wiped."""
    script = tmp_path / "inc.sh"
    script.write_text(REQUEUE_SCRIPT)
    script.chmod(0o755)
    spec = launch.load_spec(write_spec(tmp_path, """
        name: requeued
        launcher: srun
        nodes: 1
        time: "0:05:00"
        requeue: true
        script: inc.sh
    """))
    slurm = slurm_client()
    result = launch.submit(spec, slurm)
    node_logs = lambda: list((tmp_path / "logs").glob(f"requeued-{result.job_id}-*-0.out"))  # noqa: E731
    deadline = time.monotonic() + 60
    while not (node_logs() and "incarnation 0" in node_logs()[0].read_text()):
        assert time.monotonic() < deadline, "first incarnation did not start"
        time.sleep(0.5)
    slurm.requeue(result.job_id)
    tasks = wait_done(slurm, result.job_id, 120, tmp_path / "logs")
    assert tasks[0].state == "COMPLETED" and tasks[0].restart_count == 1, tasks
    text = node_logs()[0].read_text()
    assert "incarnation 0" in text and "incarnation 1" in text, text
    batch = (tmp_path / "logs" / f"requeued-{result.job_id}.out").read_text()
    assert batch.count("rendezvous at") == 2, batch  # both incarnations' batch output
