"""A chain of generations (chain: N with supervise:), without a cluster: the spec's rule, the
rendered array, the generation's identity from Slurm's variables, the state machine's hand-on
and the end marker. The chain on real Slurm: tests/integration/test_chain.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clusterops import launch
from clusterops import supervisor as sv
from clusterops.errors import ClusteropsError, InputError
from clusterops.supervisor import Exit, Requeue, StepExited, StopRequested, Supervisor
from clusterops.supervisor import chain
from support.machine import P, only, records


def _spec(tmp_path: Path, body: str) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = tmp_path / "job.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_a_supervised_chain_without_a_checkpoint_directory_is_a_one_line_error(tmp_path):
    p = _spec(tmp_path, """\
        name: long
        launcher: srun
        script: train.py
        nodes: 2
        chain: 3
        supervise:
          max_restarts: 2
        """)
    with pytest.raises(InputError) as e:
        launch.load_spec(p)
    msg = e.value.message
    assert msg.startswith(f"{p}:5: chain: a chain of 3 generations") and "supervise.ckpt_dir" in msg
    assert "\n" not in msg
    # supervise: true (no mapping) is the same
    p.write_text(p.read_text().replace("supervise:\n  max_restarts: 2\n", "supervise: true\n"))
    with pytest.raises(InputError, match=r"job.yaml:5: chain: .*supervise.ckpt_dir"):
        launch.load_spec(p)


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path):
    p = _spec(tmp_path, """\
        name: long
        launcher: srun
        script: train.py
        nodes: 1
        chain: 2
        supervise: {}
        """)
    r = subprocess.run([sys.executable, "-m", "clusterops", "launch", "render", str(p)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "job.yaml:5: chain:" in r.stderr and not r.stdout


def test_a_supervised_chain_renders_one_singleton_array(tmp_path):
    p = _spec(tmp_path, f"""\
        name: long
        launcher: srun
        script: train.py
        nodes: 2
        chain: 3
        time: "00:02:00"
        supervise:
          ckpt_dir: {tmp_path}/ck
        """)
    spec = launch.load_spec(p)
    text = launch.render(spec)
    assert "#SBATCH --array=1-3%1\n" in text and "#SBATCH --no-kill\n" in text
    assert "# Generation k of a chain of 3" in text and "Link k" not in text
    # an unsupervised chain keeps its plain links
    p.write_text(p.read_text().split("supervise:")[0])
    plain = launch.render(launch.load_spec(p))
    assert "#SBATCH --array=1-3%1\n" in plain and "# Link k of a chain of 3" in plain


def test_generation_and_run_id_come_from_the_array_variables():
    env = {"SLURM_JOB_ID": "107", "SLURM_ARRAY_JOB_ID": "105", "SLURM_ARRAY_TASK_ID": "3"}
    c = chain.from_environment({"chain": 3}, env)
    assert c == chain.ChainInfo("105", 3, 3) and not c.has_next
    assert chain.from_environment({"chain": 4}, env).has_next
    assert chain.run_id({"chain": 3}, env) == "105"
    # a lone job, or a chain's script run outside an array: its own id
    assert chain.from_environment({"chain": 1}, env) is None and chain.run_id({"chain": 1}, env) == "107"
    assert chain.run_id({"chain": 3}, {"SLURM_JOB_ID": "9"}) == "9"
    assert chain.run_id({}, {}) == "local"


def test_the_job_dir_of_every_generation_is_the_chains():
    from clusterops import protocol

    spec = {"name": "long", "log_dir": "/l", "chain": 3}
    dirs = {protocol.job_dir_for(spec, chain.run_id(spec, {"SLURM_JOB_ID": str(105 + k), "SLURM_ARRAY_JOB_ID": "105",
                                                           "SLURM_ARRAY_TASK_ID": str(k + 1)}))
            for k in range(3)}
    assert dirs == {Path("/l/long-105")}


def test_end_marker_round_trips_and_only_a_hand_on_is_not_final(tmp_path):
    assert chain.read_end(tmp_path) is None
    chain.write_end(tmp_path, {"code": 0, "reason": "training finished", "generation": 2})
    assert chain.read_end(tmp_path) == {"code": 0, "reason": "training finished", "generation": 2}
    assert oct(os.stat(chain.end_path(tmp_path)).st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == [chain.END_FILE]
    chain.end_path(tmp_path).write_text("[1, 2]")
    assert chain.read_end(tmp_path) is None
    assert not chain.is_final(sv.EXIT_GENERATION_END)
    assert all(chain.is_final(c) for c in sv.ExitCode if c != sv.EXIT_GENERATION_END)


# ---------------------------------------------------------------- the state machine's hand-on
def _stopped(chain_next: bool, **policy):
    s = Supervisor(P(nodes=2, stop_timeout_s=60, **policy), ["a", "b"], chain_next=chain_next)
    s.start(now=1000.0)
    s.handle(StopRequested(1100.0, "time_limit"))
    return s.handle(StepExited(1120.0, returncode=0, ckpt_step=57))


def test_a_generation_with_a_next_one_hands_on_at_the_time_limit_instead_of_requeueing():
    acts = _stopped(True)
    assert not only(acts, Requeue)
    ex = only(acts, Exit)[0]
    assert ex.code == sv.EXIT_GENERATION_END and "next generation resumes" in ex.reason
    assert records(acts, "generation_end") and not records(acts, "give_up")
    # the last generation (or a lone job) requeues as before
    assert only(_stopped(False), Requeue)
    # even with requeueing off or its budget spent: the next generation is not a requeue
    assert only(_stopped(True, requeue=False), Exit)[0].code == sv.EXIT_GENERATION_END
    assert only(_stopped(True, max_requeues=0), Exit)[0].code == sv.EXIT_GENERATION_END


def test_too_few_nodes_hands_on_too_but_a_finish_or_a_give_up_is_final():
    s = Supervisor(P(nodes=2), ["a"], chain_next=True)
    acts = s.start(now=1000.0)
    assert only(acts, Exit)[0].code == sv.EXIT_GENERATION_END
    s = Supervisor(P(nodes=1), ["a"], chain_next=True)
    s.start(now=1000.0)
    acts = s.handle(StepExited(1010.0, returncode=0))
    assert only(acts, Exit)[0].code == sv.EXIT_DONE and chain.is_final(sv.EXIT_DONE)
    s = Supervisor(P(nodes=1, max_restarts=0, no_progress_restarts=5), ["a"], chain_next=True)
    s.start(now=1000.0)
    acts = s.handle(StepExited(1010.0, returncode=1))
    assert only(acts, Exit)[0].code == sv.EXIT_RESTART_BUDGET and records(acts, "give_up")


# ---------------------------------------------------------------- the plumbing's start and end
def _run(tmp_path, generation, length, slurm):
    from clusterops.supervisor.run import RunConfig, SupervisorRun

    cfg = RunConfig(command=["true"], job_dir=tmp_path / "job", ckpt_dir=tmp_path / "ck", policy=P(nodes=1),
                    nodes=["node1"], job_id=str(100 + generation),
                    chain=chain.ChainInfo("100", generation, length))
    return SupervisorRun(cfg, slurm=slurm, echo=lambda s: None)


def test_a_generation_that_finds_the_end_marker_cancels_the_rest_and_trains_nothing(tmp_path):
    from support.fakes import FakeSlurm
    from clusterops.supervisor import timeline as tl

    (tmp_path / "job").mkdir(mode=0o700)
    chain.write_end(tmp_path / "job", {"code": 0, "reason": "training finished", "generation": 1})
    slurm = FakeSlurm()
    assert _run(tmp_path, 2, 3, slurm).run() == sv.EXIT_CHAIN_ENDED
    assert slurm.calls == [("cancel_pending", "100")]          # nothing launched, no step asked for
    recs = tl.read(tmp_path / "job")
    assert [r["event"] for r in recs] == ["generation", "chain_end"]
    assert recs[0]["generation"] == 2 and recs[0]["of"] == 3
    assert recs[1]["cancelled"] is True and recs[1]["ended_in"] == 1 and recs[1]["reason"] == "training finished"
    assert not list((tmp_path / "job").glob("attempt-*"))


def test_a_final_exit_writes_the_marker_before_it_cancels(tmp_path):
    from support.fakes import FakeSlurm
    from clusterops.supervisor import timeline as tl

    seen = []

    class Slurm(FakeSlurm):
        def cancel_pending(self, job_id):
            seen.append(chain.read_end(tmp_path / "job"))       # the marker is there already
            raise ClusteropsError("controller not answering")

    run = _run(tmp_path, 1, 3, Slurm())
    (tmp_path / "job").mkdir(mode=0o700)
    run.sup = Supervisor(P(nodes=1), ["node1"], chain_next=True)
    run._act_exit(Exit(sv.EXIT_DONE, "training finished"))
    assert run.exit_code == sv.EXIT_DONE
    assert seen and seen[0]["code"] == 0 and seen[0]["generation"] == 1 and seen[0]["job_id"] == "101"
    end = [r for r in tl.read(tmp_path / "job") if r["event"] == "chain_end"]
    # the cancel failed: said so; the next generation will find the marker
    assert end and end[0]["cancelled"] is False and "controller not answering" in end[0]["error"]
    # a hand-on writes nothing and cancels nothing
    run2 = _run(tmp_path / "b", 1, 3, Slurm())
    (tmp_path / "b" / "job").mkdir(parents=True, mode=0o700)
    run2.sup = Supervisor(P(nodes=1), ["node1"], chain_next=True)
    run2._act_exit(Exit(sv.EXIT_GENERATION_END, "stopped for time_limit"))
    assert chain.read_end(tmp_path / "b" / "job") is None and len(seen) == 1


def test_the_chains_last_task_names_itself_by_array_and_task_not_by_the_arrays_id(tmp_path, monkeypatch):
    # The last task of an array to start holds the array's own id: a bare `scontrol requeue 2`
    # would name every task of the chain (24.11: "2_2-3: No error", and the requeue counted failed).
    from clusterops.slurm.api import own_job_ref
    from clusterops.supervisor.run import RunConfig
    from clusterops.watchdog import Watchdog

    last = {"SLURM_JOB_ID": "2", "SLURM_ARRAY_JOB_ID": "2", "SLURM_ARRAY_TASK_ID": "3"}
    assert own_job_ref(last) == "2_3"
    assert own_job_ref(dict(last, SLURM_JOB_ID="4", SLURM_ARRAY_TASK_ID="2")) == "4"
    assert own_job_ref({"SLURM_JOB_ID": "9"}) == "9" and own_job_ref({}) == ""
    for k, v in dict(last, SLURM_JOB_NODELIST="node[1-2]").items():
        monkeypatch.setenv(k, v)
    cfg = RunConfig.from_environment(["true"], tmp_path / "job", tmp_path / "ck", P(nodes=2))
    assert cfg.job_id == "2" and cfg.slurm_job == "2_3"
    # The ranks' watchdog, which requeues the job when the batch host is lost, by the same rule.
    from clusterops import heartbeat as hbc

    sender = hbc.NodeSender("file/t0k3n", str(tmp_path / "hb"), 0, node="node1", root=str(tmp_path / "shm"))
    w = Watchdog(sender, rank=0, start=False)
    assert w.job_id == "2" and w.slurm_job == "2_3"
