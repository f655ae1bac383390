"""Slurm 25.11's expedited requeue (issue 30, part 5): where the cluster allows it, a
supervised job is submitted with ``--requeue=expedite``; an explicit ``requeue: expedite``
that the cluster cannot honour is refused before anything is written; and the supervisor
turns the job's Requeue off before a final non-zero exit, which Slurm would otherwise requeue
held. The cluster's side runs on the 25.11 tier (tests/integration/test_expedited_requeue.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterops import launch
from clusterops.errors import ClusteropsError
from clusterops.launch.submit import SpecMismatch, check_against_cluster, expedite_problem
from clusterops.supervisor import machine as sv

from support.fakes import FakeSlurm

CONFIG = "SLURM_VERSION = {}\nSlurmctldParameters     = enable_job_state_cache,{}\nSlurmctldPort = 6817\n"


class Cluster(FakeSlurm):
    def __init__(self, version=(25, 11, 7), params="enable_expedited_requeue", config_error=None):
        super().__init__()
        self._version, self.params, self.config_error, self.submitted = version, params, config_error, []

    def show_config(self):
        if self.config_error:
            raise self.config_error
        return CONFIG.format(".".join(map(str, self._version)), self.params)

    def submit(self, script=None, args=(), *, text=None, workdir=None):
        self.submitted.append(Path(script).read_text())
        return 77


def _spec(tmp_path, **extra) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    lines = ["name: exp", "nodes: 2", "launcher: srun", "script: train.py", "log_dir: logs"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    p = tmp_path / "job.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("cluster, why", [
    (Cluster(), None),
    (Cluster(version=(24, 11, 1)), "Slurm 24.11 has no expedited requeue (25.11+)"),
    (Cluster(params="enable_expedited_requeue_x"), "SlurmctldParameters lacks enable_expedited_requeue"),
    (Cluster(params="no_quick_restart"), "SlurmctldParameters lacks enable_expedited_requeue"),
    (Cluster(config_error=ClusteropsError("scontrol: timed out")), "cannot read the cluster's configuration"),
    # the client tools' version does not count: the controller's, from the same answer
    (type("C", (Cluster,), {"version": lambda self: (25, 11, 7)})(version=(24, 11, 3)),
     "Slurm 24.11 has no expedited requeue"),
])
def test_what_the_cluster_allows(cluster, why):
    got = expedite_problem(cluster)
    assert (got is None) if why is None else (why in got)


def test_a_supervised_job_gets_the_expedited_requeue_only_where_the_cluster_allows_it(tmp_path):
    sup = launch.load_spec(_spec(tmp_path, supervise="{max_requeues: 2}"))
    assert sup.requeue is True
    assert check_against_cluster(sup, Cluster()).requeue == "expedite"
    assert check_against_cluster(sup, Cluster(version=(24, 11, 1))).requeue is True
    assert check_against_cluster(sup, Cluster(params="")).requeue is True
    # an unsupervised job keeps what it asked: a plain requeue, or none
    plain = launch.load_spec(_spec(tmp_path, requeue="true"))
    assert check_against_cluster(plain, Cluster()).requeue is True
    off = launch.load_spec(_spec(tmp_path, supervise="{max_requeues: 2}", requeue="false"))
    assert check_against_cluster(off, Cluster()).requeue is False


def test_the_submitted_script_and_the_supervisors_spec_carry_it(tmp_path, monkeypatch):
    import json

    from clusterops.supervisor.config import run_config

    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    spec = launch.load_spec(_spec(tmp_path, supervise="{max_requeues: 2}"))
    cluster = Cluster()
    done = launch.submit(spec, cluster)
    assert done.job_id == 77 and "#SBATCH --requeue=expedite\n" in cluster.submitted[0]
    resolved = json.loads(Path(done.spec_file).read_text())
    assert resolved["requeue"] == "expedite"
    settings = {"job_dir": str(tmp_path / "jobdir")}
    assert run_config(resolved, ["--", "true"], settings).expedited_requeue is True
    assert run_config(dict(resolved, requeue=True), ["--", "true"], settings).expedited_requeue is False
    # a dry run asks no cluster: the ordinary requeue
    assert "#SBATCH --requeue\n" in launch.submit(spec, None, dry_run=True).script


def test_an_explicit_expedite_the_cluster_cannot_honour_is_refused_before_anything_is_written(tmp_path):
    spec = launch.load_spec(_spec(tmp_path, requeue="expedite"))
    assert "#SBATCH --requeue=expedite\n" in launch.render(spec)
    old = Cluster(version=(22, 5, 8))
    with pytest.raises(SpecMismatch, match=r"^requeue: expedite: Slurm 22\.05 has no expedited requeue "
                                           r"\(25\.11\+\); use requeue: true$"):
        launch.submit(spec, old)
    assert not old.submitted and not (tmp_path / "logs").exists()
    assert launch.submit(spec, Cluster()).job_id == 77


def test_a_bad_requeue_value_names_the_line(tmp_path):
    from clusterops.errors import InputError

    with pytest.raises(InputError, match=r"job\.yaml:6: requeue: must be bool or expedite, got 'expedited'"):
        launch.load_spec(_spec(tmp_path, requeue="expedited"))


def _run(tmp_path, *, expedited=True, slurm=None):
    from clusterops.supervisor.run import RunConfig, SupervisorRun

    cfg = RunConfig(command=["true"], job_dir=tmp_path / "job", ckpt_dir=tmp_path / "ck",
                    policy=sv.Policy(nodes=1), nodes=["node1"], job_id="55", expedited_requeue=expedited)
    (tmp_path / "job").mkdir(mode=0o700, exist_ok=True)
    return SupervisorRun(cfg, slurm=slurm or FakeSlurm(), echo=lambda s: None)


@pytest.mark.parametrize("code, asked_requeue, expedited, turned_off", [
    (sv.EXIT_NO_PROGRESS, False, True, True),      # a give-up: the job must end, not come back held
    (sv.EXIT_DONE, False, True, False),            # exit 0 completes the job anyway
    (sv.EXIT_NO_PROGRESS, True, True, False),      # this process requeued the job itself
    (sv.EXIT_NO_PROGRESS, False, False, False),    # no expedited requeue: nothing to undo
])
def test_the_final_exit_turns_requeue_off_only_where_slurm_would_hold_the_job(tmp_path, code, asked_requeue,
                                                                               expedited, turned_off):
    from clusterops.supervisor import timeline as tl

    run = _run(tmp_path, expedited=expedited)
    run.exit_code, run.requeue_asked = code, asked_requeue
    run._final_exit_no_requeue()
    assert (("update_job", "55", {"Requeue": 0}) in run.slurm.calls) is turned_off
    recs = tl.read(tmp_path / "job") if (tmp_path / "job" / "timeline.jsonl").exists() else []
    assert bool([r for r in recs if r["event"] == "requeue_off"]) is turned_off


def test_a_failed_requeue_off_is_said_with_what_to_do(tmp_path):
    from clusterops.supervisor import timeline as tl

    class Refusing(FakeSlurm):
        def update_job(self, job_id, **fields):
            raise ClusteropsError("scontrol: Socket timed out")

    run = _run(tmp_path, slurm=Refusing())
    run.exit_code = sv.EXIT_NO_PROGRESS
    run._final_exit_no_requeue()
    warn = [r["what"] for r in tl.read(tmp_path / "job") if r["event"] == "warning"]
    assert warn and "Socket timed out" in warn[0] and "scancel" in warn[0]


def test_a_generation_that_finds_its_chain_ended_turns_requeue_off_before_exiting(tmp_path):
    from clusterops.supervisor import chain
    from clusterops.supervisor.run import RunConfig, SupervisorRun

    (tmp_path / "job").mkdir(mode=0o700)
    chain.write_end(tmp_path / "job", {"code": 0, "reason": "training finished", "generation": 1})
    slurm = FakeSlurm()
    cfg = RunConfig(command=["true"], job_dir=tmp_path / "job", ckpt_dir=tmp_path / "ck", policy=sv.Policy(nodes=1),
                    nodes=["node1"], job_id="102", chain=chain.ChainInfo("100", 2, 3), expedited_requeue=True)
    assert SupervisorRun(cfg, slurm=slurm, echo=lambda s: None).run() == sv.EXIT_CHAIN_ENDED
    assert slurm.calls == [("cancel_pending", "100"), ("update_job", "102", {"Requeue": 0})]
