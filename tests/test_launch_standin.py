"""Run the rendered batch scripts with bash, with stand-ins for srun, scontrol and the launchers.

The srun stand-in runs its command once per fake task, concurrently, with the
SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID / SLURMD_NODENAME a real srun gives each
task, so the tests see the command line and environment every node gets. The launcher
stand-ins (torchrun, accelerate, deepspeed, python) record their argv, environment and
whether SIGUSR1 is ignored. Hostile values must come through literally and no injected
command may run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops import launch

SRUN = r"""#!/bin/bash
# srun stand-in: records argv, runs the command once per task (concurrently), forwards
# USR1/TERM to the tasks like srun, exits with the first failing task's status.
printf '%s\0' "$@" > "$STANDIN_DIR/srun.argv"
nodes=1; tpn=1
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes=*) nodes=${1#*=} ;;
        --ntasks-per-node=*) tpn=${1#*=} ;;
        -*) ;;
        *) break ;;
    esac
    shift
done
pids=()
_fwd() { echo "$1" >> "$STANDIN_DIR/srun.signals"; kill -s "$1" "${pids[@]}" 2>/dev/null; }
trap '_fwd USR1' USR1
trap '_fwd TERM' TERM
for ((n = 0; n < nodes; n++)); do
    for ((t = 0; t < tpn; t++)); do
        SLURM_NODEID=$n SLURM_PROCID=$((n * tpn + t)) SLURM_LOCALID=$t SLURM_NTASKS=$((nodes * tpn)) \
        SLURM_STEP_NUM_NODES=$nodes SLURMD_NODENAME=node$((n + 1)) "$@" &
        pids+=($!)
    done
done
rc=0
for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null; do wait "$p" || true; done
    s=0; wait "$p" || s=$?
    if [ "$rc" = 0 ]; then rc=$s; fi
done
exit "$rc"
"""

SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$STANDIN_DIR/scontrol.log"
case "$1 $2" in
    "show hostnames") for n in $STANDIN_NODES; do echo "$n"; done ;;
    "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=standin State=IDLE" ;;
    *) echo "scontrol stand-in: unsupported: $*" >&2; exit 1 ;;
esac
"""

LAUNCHER = r"""#!{python}
# Launcher / interpreter stand-in: records what it was given; optionally lingers.
import json, os, sys, time
name = os.path.basename(sys.argv[0])
with open("/proc/self/status") as f:
    ign = int([l.split()[1] for l in f if l.startswith("SigIgn:")][0], 16)
record = {{"prog": name, "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
          "usr1_ignored": bool(ign & (1 << (10 - 1))), "pid": os.getpid()}}
d = os.environ["STANDIN_DIR"]
tag = os.environ.get("SLURM_PROCID", "x")
with open(os.path.join(d, f".task-{{tag}}.tmp"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(d, f".task-{{tag}}.tmp"), os.path.join(d, f"task-{{tag}}.json"))
release = os.path.join(d, "release")
if os.environ.get("STANDIN_LINGER"):
    deadline = time.monotonic() + 30
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(release):
        codes = json.load(open(release))
        sys.exit(int(codes.get(tag, 0)))
"""

HOSTILE = [
    "space and 'single' \"double\" quotes",
    "semi; touch $CANARY_DIR/semi",
    "$(touch $CANARY_DIR/subst)",
    "`touch $CANARY_DIR/backtick`",
    "new\nline; touch $CANARY_DIR/newline",
    "glob * ? [a] ~ # hash & amp | pipe > redirect",
    "\\back\\slash and $HOME and ${PATH}",
    "'; touch $CANARY_DIR/quote_escape; '",
]


@pytest.fixture
def standin(tmp_path):
    """A bin dir of stand-ins and a function that runs a rendered script with them."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(SRUN)
    (bindir / "scontrol").write_text(SCONTROL)
    for prog in ("torchrun", "accelerate", "deepspeed", "python3", "python"):
        (bindir / prog).write_text(LAUNCHER.format(python=sys.executable))
    for p in bindir.iterdir():
        p.chmod(0o755)
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    canary_dir = tmp_path / "canary"
    canary_dir.mkdir()

    def env_for(nodes: int, **extra) -> dict:
        env = dict(os.environ)
        env.update({
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "STANDIN_DIR": str(record_dir),
            "STANDIN_NODES": " ".join(f"node{i}" for i in range(1, nodes + 1)),
            "CANARY_DIR": str(canary_dir),
            "SLURM_JOB_ID": "4321",
            "SLURM_JOB_NAME": "standin",
            "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_CPUS_PER_TASK": "2",
        })
        env.update(extra)
        return env

    def records():
        out = {}
        for p in record_dir.glob("task-*.json"):
            rec = json.loads(p.read_text())
            out[int(rec["env"]["SLURM_PROCID"])] = rec
        return out

    def srun_argv():
        return (record_dir / "srun.argv").read_bytes().decode().split("\0")[:-1]

    class Standin:
        pass

    s = Standin()
    s.bindir, s.dir, s.canary_dir = bindir, record_dir, canary_dir
    s.env_for, s.records, s.srun_argv = env_for, records, srun_argv
    return s


def make_spec(tmp_path: Path, launcher: str, **keys) -> launch.JobSpec:
    script = keys.pop("script_path", tmp_path / "train.py")
    script.write_text("print('train')\n")
    data = {"name": "standin", "nodes": 3, "launcher": launcher, "script": str(script),
            "nproc_per_node": 2, "time": "1:00:00", "workdir": str(tmp_path)}
    data.update(keys)
    return launch.JobSpec.from_dict(data)


def run_script(text: str, path: Path, env: dict, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    return subprocess.run(["bash", str(path)], env=env, cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("launcher", launch.LAUNCHERS)
def test_every_node_gets_its_own_values(launcher, tmp_path, standin):
    args = ["--out", "x y", *HOSTILE]
    env_values = {"WEIRD": HOSTILE[2] + HOSTILE[3], "MULTI": "a\nb"}
    spec = make_spec(tmp_path, launcher, args=args, env=env_values, cpus_per_task=2)
    done = run_script(launch.render(spec), tmp_path / "job.sh", standin.env_for(3), tmp_path)
    assert done.returncode == 0, done.stderr
    assert list(standin.canary_dir.iterdir()) == []  # no injected command ran

    argv = standin.srun_argv()
    tpn = 2 if launcher == "srun" else 1
    assert argv[:6] == ["--kill-on-bad-exit=1", "--wait=60", "--nodes=3", f"--ntasks-per-node={tpn}",
                        f"--output={spec.log_dir}/%x-%j-%N-%n.out", "--open-mode=append"]
    recs = standin.records()
    assert sorted(recs) == list(range(3 * tpn))
    ports = {r["env"]["MASTER_PORT"] for r in recs.values()}
    addrs = {r["env"]["MASTER_ADDR"] for r in recs.values()}
    assert addrs == {"127.0.0.1"}  # node1 does not resolve here: Slurm's NodeAddr
    assert len(ports) == 1 and 10000 <= int(ports.pop()) < 30000
    for procid, rec in recs.items():
        env = rec["env"]
        node = procid // tpn
        assert env["SLURMD_NODENAME"] == f"node{node + 1}"
        assert env["SRUN_CPUS_PER_TASK"] == "2"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["WEIRD"] == env_values["WEIRD"] and env["MULTI"] == "a\nb"
        assert rec["cwd"] == str(tmp_path)
        a = rec["argv"]
        assert a[-len(args):] == args, a  # literal, in order, one argv item each
        assert a[-len(args) - 1] == spec.script
        if launcher == "torchrun":
            assert rec["prog"] == "torchrun" and rec["usr1_ignored"]
            assert a[:5] == ["--nnodes=3", "--nproc-per-node=2", f"--node-rank={node}",
                             "--master-addr=127.0.0.1", f"--master-port={env['MASTER_PORT']}"]
        elif launcher == "accelerate":
            assert rec["prog"] == "accelerate" and rec["usr1_ignored"]
            assert a[:4] == ["launch", "--multi_gpu", "--num_machines=3", "--num_processes=6"]
            assert f"--machine_rank={node}" in a and "--main_process_ip=127.0.0.1" in a
        elif launcher == "deepspeed":
            assert rec["prog"] == "deepspeed" and rec["usr1_ignored"]
            assert f"--node_rank={node}" in a and "--no_ssh" in a and "--num_nodes=3" in a
            hostfile = a[0].split("=", 1)[1]
            assert Path(hostfile).read_text() == "node1 slots=2\nnode2 slots=2\nnode3 slots=2\n"
        else:  # srun: one task per rank, rank variables from Slurm on each node
            assert rec["prog"] == "python3" and not rec["usr1_ignored"]
            assert env["RANK"] == str(procid) and env["WORLD_SIZE"] == "6"
            assert env["LOCAL_RANK"] == str(procid % 2) and env["NODE_RANK"] == str(node)
            assert env["LOCAL_WORLD_SIZE"] == "2"


def test_hostile_paths_and_names(tmp_path, standin):
    # A working directory, log dir and script path full of shell syntax.
    weird = tmp_path / "we'ird \"dir\" $(cd $CANARY_DIR && touch dir) `cd $CANARY_DIR && touch bt`; x & y"
    weird.mkdir()
    script = weird / "tr ain's $(x).py"
    name = "job \"name\" 'x' $(cd $CANARY_DIR && touch name) `id` ; # not a comment"
    spec = make_spec(tmp_path, "torchrun", script_path=script, workdir=str(weird), name=name,
                     args=[HOSTILE[1]], env={"A": HOSTILE[7]},
                     sbatch_args=['--comment=a "b" #c $(d)'], srun_args=["--label=$(touch x)"])
    text = launch.render(spec)
    assert spec.log_dir == str(weird / "logs")
    done = run_script(text, tmp_path / "job.sh", standin.env_for(3), weird)
    assert done.returncode == 0, done.stderr
    assert list(standin.canary_dir.iterdir()) == []
    recs = standin.records()
    assert len(recs) == 3
    for rec in recs.values():
        assert rec["argv"][-2:] == [str(script), HOSTILE[1]]
        assert rec["env"]["A"] == HOSTILE[7]
        assert rec["env"]["CLUSTEROPS_LOG_DIR"] == str(weird / "logs")
    argv = standin.srun_argv()
    assert f"--output={weird}/logs/%x-%j-%N-%n.out" in argv and "--label=$(touch x)" in argv


def test_setup_lines_are_verbatim_shell(tmp_path, standin):
    spec = make_spec(tmp_path, "srun", setup=["export FROM_SETUP=$((6 * 7))", "cd ."])
    done = run_script(launch.render(spec), tmp_path / "job.sh", standin.env_for(3), tmp_path)
    assert done.returncode == 0, done.stderr
    assert {r["env"]["FROM_SETUP"] for r in standin.records().values()} == {"42"}


def test_setup_failure_stops_the_job(tmp_path, standin):
    spec = make_spec(tmp_path, "torchrun", setup=["false"])
    done = run_script(launch.render(spec), tmp_path / "job.sh", standin.env_for(3), tmp_path)
    assert done.returncode == 1
    assert standin.records() == {} and not (standin.dir / "srun.argv").exists()


def test_signal_forwarding_and_exit_status(tmp_path, standin):
    """USR1 to the batch shell reaches srun; the shell keeps waiting and returns the step's status."""
    spec = make_spec(tmp_path, "torchrun")
    path = tmp_path / "job.sh"
    path.write_text(launch.render(spec))
    env = standin.env_for(3, STANDIN_LINGER="1")
    proc = subprocess.Popen(["bash", str(path)], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(standin.records()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(standin.records()) == 3
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1):
            proc.send_signal(sig)
            time.sleep(0.3)
            assert proc.poll() is None, "the batch shell must outlive a trapped signal"
        # The launchers ignore USR1, so they are all still there; end them, one failing.
        (standin.dir / "release.tmp").write_text(json.dumps({"0": 0, "1": 3, "2": 0}))
        os.replace(standin.dir / "release.tmp", standin.dir / "release")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err
    assert (standin.dir / "srun.signals").read_text().split() == ["USR1", "USR1"]
    assert err.count("SIGUSR1 received; forwarding it to the job step") == 2
    assert "SIGTERM received; waiting for the job step to stop" in err
    assert "job step exited with status 3" in err


def test_master_port_skips_a_busy_port(tmp_path, standin):
    import socket

    spec = make_spec(tmp_path, "torchrun")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 10000 + 4321))
        except OSError:
            pytest.fail("port 14321 is taken on this machine; the test needs it free to occupy it")
        s.listen(8)
        done = run_script(launch.render(spec), tmp_path / "job.sh", standin.env_for(3), tmp_path)
    assert done.returncode == 0, done.stderr
    assert {r["env"]["MASTER_PORT"] for r in standin.records().values()} == {"14322"}


def test_fixed_master_port_and_chain_env(tmp_path, standin):
    spec = make_spec(tmp_path, "srun", master_port=23456, chain=3)
    done = run_script(launch.render(spec), tmp_path / "job.sh",
                      standin.env_for(3, SLURM_ARRAY_TASK_ID="2"), tmp_path)
    assert done.returncode == 0, done.stderr
    envs = [r["env"] for r in standin.records().values()]
    assert {e["MASTER_PORT"] for e in envs} == {"23456"}
    assert {(e["CLUSTEROPS_CHAIN_LINK"], e["CLUSTEROPS_CHAIN_LENGTH"]) for e in envs} == {("2", "3")}


def test_unresolvable_nodelist_fails_clearly(tmp_path, standin):
    spec = make_spec(tmp_path, "torchrun")
    env = standin.env_for(3, STANDIN_NODES="")
    done = run_script(launch.render(spec), tmp_path / "job.sh", env, tmp_path)
    assert done.returncode == 1 and "cannot expand SLURM_JOB_NODELIST" in done.stderr
    assert not (standin.dir / "srun.argv").exists()
