"""A stranger against a running in-process job's rendezvous, on the real dev cluster (issue 32).

The job (root's) trains examples/train_recoverable.py under ``supervise: inprocess:`` on 4
nodes with a warm standby each. Another local user, who knows only the rendezvous's port
(anyone on the node can find it: ``/proc/net/tcp``), runs torch's own TCPStore client against
it and tries what gave code execution and kills before the store was sealed: list every
key and read every value; forge the next generation's plan (a standby as a rank, the
stranger's choice of source), kill orders for the job's processes and for an unrelated
process of the job's user, an abort, the finish mark; bump the report counter far ahead and
write forged reports and joins; put a pickle that runs code in the process group's keys and
the plan; hold a flood of connections, some sending garbage. Then a real fault: rank 2
SIGKILLs itself. What must hold: nothing of it was readable or obeyed (no fault opened, no
process killed, the unrelated process alive, the canary file the pickle would create never
made), and the real fault heals in-process, the final weights bitwise equal to an
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from support import faultkit as fk
from support import users
from support.wait import wait_for
from clusterops.runner import Runner
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 60
CKPT_EVERY = 10
SCRIPT = fk.REPO / "examples" / "train_recoverable.py"

STRANGER = r'''
import datetime, json, os, pickle, socket, sys, time
import torch.distributed as dist

port, canary, victims = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
seen = {"keys": 0, "readable": 0, "prefixes": []}

def client():
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))

s = client()
keys = s.list_keys()
seen["keys"] = len(keys)
prefixes = sorted({k.split("/", 1)[0] for k in keys})
seen["prefixes"] = prefixes
for k in keys:
    try:
        v = s.get(k)
    except Exception:
        continue
    if b"ranks" in v or b"hello" in v or b'"kind"' in v:
        seen["readable"] += 1

class Evil:
    def __reduce__(self):
        return (os.system, (f"id > {canary}",))

evil = pickle.dumps(Evil())
for p in prefixes:
    uids = [f"node{n}:{pid}" for n, pid in victims]
    forged = {"gen": 1, "world": 4, "ranks": {u: i for i, u in enumerate(uids[:4])},
              "standby": [], "src": 3, "step": 999}
    s.set(f"{p}/plan/1", json.dumps(forged))
    for u in uids:
        s.set(f"{p}/kill/{u}", u.split(":")[0])
    s.set(f"{p}/abort/1", "rank 0 lost")
    s.set(f"{p}/finish", "1")
    for u in uids:
        n = s.add(f"{p}/rep/n", 1)
        s.set(f"{p}/rep/{n}", json.dumps({"kind": "dead", "uid": u, "dead": u}))
    s.add(f"{p}/rep/n", 1000000)
    s.append(f"{p}/join/1", "".join(f"{u} {i} 999\n" for i, u in enumerate(uids)))
    for r in range(8):
        s.set(f"{p}/pg/1/{r}", evil)
        s.set(f"{p}/pg/0/{r}", evil)
    s.set(f"{p}/plan/2", evil)

flood, garbage = [], 0
for i in range(300):
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        break
    if i % 10 == 0:
        try:
            c.sendall(os.urandom(256))
            garbage += 1
        except OSError:
            pass
    flood.append(c)
seen["flood"] = len(flood)
seen["garbage"] = garbage
time.sleep(5)
for c in flood:
    c.close()
print(json.dumps(seen))
'''


def events(job, kind):
    return [r for r in job.timeline() if r["event"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = tmp_path_factory.mktemp("stranger-ref")
    out = ref / "final.pt"
    fk.run_local(4, ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--out", str(out)], workdir=ref,
                 script=SCRIPT)
    return out


@pytest.fixture(scope="module")
def user():
    pw = users.ensure_user()
    with users.python_reachable(pw.pw_name):
        yield pw


def rdzv_port(job) -> int:
    text = (job.latest_attempt() / "command.txt").read_text()
    m = re.search(r"^CLUSTEROPS_RDZV_ADDR=[^:\n]+:(\d+)/", text, re.M)
    assert m, text
    return int(m.group(1))


def train_pids(job_dir) -> list:
    """(node number, pid) of every process of the job's step (ranks and standbys)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        argv0 = os.path.basename(cmd.split(b"\0")[0])
        # the step's tasks: python running the script, with a task id (not srun, not the supervisor)
        if (b"train_recoverable.py" in cmd and argv0.startswith(b"python") and b"\0SLURM_LOCALID=" in b"\0" + env
                and b"\0SLURM_STEP_ID=" in b"\0" + env and str(job_dir).encode() in cmd + env
                and b"CLUSTEROPS_RDZV_ADDR=" in env):
            m = re.search(rb"SLURMD_NODENAME=node(\d+)", env)
            if m:
                out.append((int(m.group(1)), int(pid)))
    return sorted(out)


@pytest.mark.timeout(600)
def test_a_stranger_at_the_rendezvous_port_reads_nothing_steers_nothing_and_the_job_heals(
        cluster, tmp_path, reference, user):
    from clusterops.slurm.factory import connect

    gate = tmp_path / "gate"
    job = fk.TrainJob(root=tmp_path / "strg", name="strg", nodes=4, steps=STEPS, ckpt_every=CKPT_EVERY,
                      step_sleep=0.3, script=SCRIPT,
                      train_args=["--second-crash-at-step", "50", "--second-crash-rank", "2",
                                  "--second-crash-marker", str(tmp_path / "crashed"),
                                  "--second-crash-gate", str(gate)],
                      supervise={"inprocess": {"standbys_per_node": 1}})
    job.submit()
    slurm = connect()
    job.wait_step(5, timeout_s=240)
    port = rdzv_port(job)
    victims = train_pids(job.root)
    assert len(victims) == 8, victims
    bystander = subprocess.Popen(["sleep", "300"], env=dict(os.environ, SLURMD_NODENAME="node1"))
    with users.user_dir(user.pw_name) as home:
        canary = home / "pwned"
        script = home / "stranger.py"
        script.write_text(STRANGER)
        os.chown(script, user.pw_uid, user.pw_gid)
        victims_arg = json.dumps(victims + [(1, bystander.pid)])
        res = Runner(as_user=user.pw_name).run([sys.executable, str(script), str(port), str(canary), victims_arg],
                                               timeout_s=120, check=False, cwd=str(home))
        assert res.returncode == 0, res.stderr[-2000:]
        seen = json.loads(res.stdout.strip().splitlines()[-1])
        time.sleep(2)          # the rendezvous's loop has read whatever it would
        assert seen["keys"] > 0 and seen["readable"] == 0, seen     # listed, but nothing readable
        assert seen["flood"] >= 100, seen
        alive = [pid for _, pid in victims if os.path.exists(f"/proc/{pid}")]
        assert alive == [pid for _, pid in victims], "a forged kill order was obeyed"
        assert bystander.poll() is None, "the unrelated process was killed"
        assert not events(job, "inproc_fault"), tl.format_text(job.timeline())
        gate.write_text("go\n")         # now the real fault: rank 2 SIGKILLs itself at step 50
        info = job.wait_end(slurm, timeout_s=400)
        assert not canary.exists(), "the stranger's pickle ran"
    bystander.kill()
    story = tl.format_text(job.timeline())
    assert info.state == "COMPLETED" and info.exit_code == 0, f"{info.state}\n{story}\n{job.batch_log()[-3000:]}"
    assert (tmp_path / "crashed").exists(), story
    assert len(events(job, "launch")) == 1 and not events(job, "restart"), story
    rdzv = events(job, "inproc_rendezvous")
    assert len(rdzv) == 1 and rdzv[0]["step"] == 50 and [m["rank"] for m in rdzv[0]["replaced"]] == [2], story
    assert events(job, "inproc_first_step") and not events(job, "inproc_fallback"), story
    assert fk.same_weights(job.out, reference), f"final weights differ from an uninterrupted run\n{story}"
