"""The cron pass's rules (clusterops.jobwatch.assess) on plain values; on the dev cluster:
tests/integration/test_job_watch_cron.py."""

from __future__ import annotations

from click.testing import CliRunner

from clusterops import jobwatch
from clusterops.jobs import JobStatus

NOW = 10_000.0


def st(**kw) -> JobStatus:
    kw.setdefault("state", "RUNNING")
    return JobStatus(job_id="42", job_dir="/j", user="alice", **kw)


def flags(status, records, rules, ckpt_time=None):
    return [f.flag for f in jobwatch.assess(status, records, rules, now=NOW, ckpt_time=ckpt_time)]


def test_restart_storm_counts_restarts_requeues_and_hand_ons_in_the_window_only():
    recs = [{"t": NOW - 5000, "event": "restart"}] + [{"t": NOW - 100 * k, "event": e}
                                                       for k, e in enumerate(["restart", "requeue", "generation_end"])]
    assert flags(st(), recs, jobwatch.Rules(max_restarts=3)) == []
    assert flags(st(), recs, jobwatch.Rules(max_restarts=2)) == ["restart_storm"]
    assert flags(st(), recs, jobwatch.Rules(max_restarts=0, window_s=150)) == ["restart_storm"]   # 2 in 150 s
    assert flags(st(), recs, jobwatch.Rules(max_restarts=2, window_s=150)) == []
    # a job that ended is nobody's alarm any more
    assert flags(st(finished=True), recs, jobwatch.Rules(max_restarts=0)) == []


def test_stalled_is_a_running_job_whose_latest_good_checkpoint_is_too_old():
    recs = [{"t": NOW - 600, "event": "start"}]
    rules = jobwatch.Rules(stall_s=300)
    assert flags(st(), recs, rules, ckpt_time=NOW - 100) == []
    assert flags(st(), recs, rules, ckpt_time=NOW - 400) == ["stalled"]
    assert flags(st(), recs, rules, ckpt_time=None) == ["stalled"]          # none at all, 600 s in
    # just started (this incarnation): not yet
    assert flags(st(), recs + [{"t": NOW - 60, "event": "start"}], rules, ckpt_time=NOW - 4000) == []
    # pending (waiting for nodes) is not a stall
    assert flags(st(state="PENDING"), recs, rules, ckpt_time=NOW - 4000) == []
    f = jobwatch.assess(st(latest_checkpoint={"path": "/c", "step": 7}), recs, rules, now=NOW, ckpt_time=NOW - 400)[0]
    assert "step 7" in f.detail and "400 s old" in f.detail and f.user == "alice" and f.job_id == "42"


def test_chain_dry_is_a_chain_with_nothing_queued_and_training_not_finished():
    def chain(*states, ended=False):
        return {"length": len(states), "ended": ended, "why": None,
                "generations": [{"generation": i + 1, "state": s} for i, s in enumerate(states)]}

    rules = jobwatch.Rules()
    assert flags(st(chain=chain("FAILED", "RUNNING", "PENDING")), [], rules) == []
    assert flags(st(chain=chain("FAILED", "FAILED", "RUNNING")), [], rules) == ["chain_dry"]
    assert flags(st(chain=chain("FAILED", "RUNNING", "PENDING"), outcome=None), [], jobwatch.Rules(chain_dry=False)) == []
    # a chain that ended (finished, gave up) is not dry; nor is a lone job
    assert flags(st(chain=chain("COMPLETED", "CANCELLED", "CANCELLED", ended=True)), [], rules) == []
    assert flags(st(chain=chain("FAILED", "RUNNING"), outcome="done"), [], rules) == []
    assert flags(st(), [], rules) == []


def test_the_metrics_name_each_flag():
    text = jobwatch.prometheus_text([{"job_id": "42", "user": "alice", "flag": "stalled"}], when=NOW)
    assert 'clusterops_watch_job_flagged{flag="stalled",job="42",user="alice"} 1.0' in text
    assert "clusterops_watch_flagged_jobs 1.0" in text


def test_cron_options_with_a_job_id_are_a_usage_error():
    from clusterops.cli.job import job

    r = CliRunner().invoke(job, ["watch", "42", "--stall-s", "60"])
    assert r.exit_code == 2 and "without JOB_ID" in r.output
