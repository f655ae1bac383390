"""A user's own DDP script, written the plain way, under `supervise:` (issue 28), on the dev cluster.

The script below is what a newcomer writes: ``torch.optim.SGD`` without momentum (its
``state_dict()`` has an empty ``"state"``), ``model.state_dict()`` and ``opt.state_dict()``
handed to ``sdk.save`` as they are, ``sdk.resume()`` fed back through ``load_state_dict``.
Two nodes, one rank each (the SDK's many-rank path).

- Healing: rank 1 is SIGKILLed mid-run, with and without the stability guard; the job
  finishes with final weights bitwise equal to an uninterrupted run (the resumed optimizer
  state loads, and saves again).
- Blame with evidence: the same script raising only on one node (a condition of that
  node's own environment: ``SLURMD_NODENAME``) with a spare: the same error twice from that
  node is weighed, the relaunch without it gets past the failure point, and only then is the
  node blamed (excluded, not drained: ``drain_bad_nodes`` off); the run still ends bitwise
  equal to the uninterrupted one. A traceback on one rank of four blames nobody.
"""

from __future__ import annotations

import signal
import textwrap

import pytest

from support import faultkit as fk
from support.user_scripts import USER_SCRIPT
from clusterops import supervisor as sv
from clusterops.supervisor import timeline as tl

pytestmark = pytest.mark.integration

STEPS = 40
CKPT_EVERY = 10


GUARD = {"on_nan": "rollback", "on_spike": "record", "warmup_steps": 10, "min_samples": 4}


@pytest.fixture
def slurm(cluster):
    from clusterops.slurm.factory import connect

    return connect()


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "user_ddp.py"
    p.write_text(USER_SCRIPT)
    return p


@pytest.fixture
def reference(tmp_path, script):
    d = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(STEPS), "--ckpt-every", "0", "--out", str(d / "final.pt")],
                 workdir=d, script=script)
    return d / "final.pt"


def _job(tmp_path, script, name, **kw):
    return fk.TrainJob(root=tmp_path / name, name=name, nodes=kw.pop("nodes", 2), steps=STEPS,
                       ckpt_every=CKPT_EVERY, step_sleep=0.15, script=script, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("guard", [False, True], ids=["plain", "stability-guard"])
def test_plain_sgd_script_heals_a_kill9_bitwise(cluster, slurm, tmp_path, script, reference, guard):
    job = _job(tmp_path, script, "user-guard" if guard else "user",
               supervise={"stability": GUARD} if guard else {})
    job.submit()
    job.wait_step(15)
    assert job.signal_rank(1, signal.SIGKILL)
    info, story = fk.assert_healed(job, slurm, reference, timeout_s=240)
    exits = fk.events(job, "step_exit")
    assert exits[0]["cause"] == "rank_killed" and exits[0]["blamed"] == ["node2"], story
    resumed = [r for r in fk.events(job, "resume") if r.get("step") is not None]
    assert resumed and resumed[-1]["step"] >= CKPT_EVERY, story          # the optimizer state loaded
    assert not fk.events(job, "rollback") and not fk.events(job, "nan"), story


@pytest.mark.timeout(300)
def test_error_from_one_node_only_is_weighed_then_blamed_without_a_drain(cluster, slurm, tmp_path, script,
                                                                          reference):
    job = _job(tmp_path, script, "onenode",
               supervise={"spare_nodes": 1, "drain_bad_nodes": False, "no_progress_restarts": 3},
               train_args=["--raise-on-node", "node2", "--raise-at", "12"])
    job.submit()
    info, story = fk.assert_healed(job, slurm, reference, timeout_s=240)
    story += job.failed_step_logs()
    exits = [e for e in fk.events(job, "step_exit") if e["returncode"] != 0]
    assert len(exits) == 2, story
    for e in exits:          # the program's own error each time: nobody blamed by the step
        assert e["cause"] == "program_error" and e["blamed"] == [], story
        assert e.get("error") == "RuntimeError: scratch on node2 is not writable", story
    weighed = [(r["node"], r["decision"]) for r in fk.events(job, "node_suspect")]
    assert weighed == [("node2", "trial"), ("node2", "blamed")], story
    # The trial ran without node2 (on the spare) and got past step 12: then node2 was blamed.
    launches = fk.events(job, "launch")
    assert "node2" not in launches[-1]["nodes"] and "node3" in launches[-1]["nodes"], story
    assert [r["node"] for r in fk.events(job, "node_bad")] == ["node2"], story
    # Excluded, never drained (drain_bad_nodes off); no requeue needed.
    assert not fk.events(job, "drain") and not slurm.node("node2").drained, story
    assert not fk.events(job, "requeue") and info.restart_count == 0, story


RAISES_ON_RANK2 = textwrap.dedent("""\
    import os, time
    from clusterops import sdk          # a user's script with the SDK (its error report)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    print("step=0", flush=True)
    if rank == 2:
        raise ValueError("bad shard 7")
    time.sleep(60)                      # the others: srun ends them once rank 2 has failed
    """)


@pytest.mark.timeout(200)
def test_traceback_on_one_rank_of_four_blames_nobody(cluster, slurm, tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES_ON_RANK2)
    job = fk.TrainJob(root=tmp_path / "four", name="four", nodes=4, script=script,
                      supervise={"progress": {"regex": r"step=(\d+)"}, "no_progress_restarts": 1,
                                 "node_fail_threshold": 1})
    job.args = lambda: []
    job.submit()
    info = job.wait_end(slurm, timeout_s=160)
    story = tl.format_text(job.timeline()) + job.failed_step_logs()
    assert info.exit_code == sv.EXIT_NO_PROGRESS, f"{info.state} {info.exit_code}\n{story}"
    exits = fk.events(job, "step_exit")
    assert len(exits) == 2, story
    for e in exits:
        assert e["cause"] == "program_error" and e["blamed"] == [], story
        assert e["failures"][0]["rank"] == 2 and e.get("error") == "ValueError: bad shard 7", story
    assert not fk.events(job, "node_bad") and not fk.events(job, "drain") and not fk.events(job, "requeue"), story
    assert fk.events(job, "give_up")[0]["error"] == "ValueError: bad shard 7", story
