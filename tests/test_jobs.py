"""Supervised jobs by their id (clusterops.jobs): where the directory is found, the status sums,
the refusal of another user's job; Slurm's owner and script parsed from recorded output."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest

from clusterops import jobs
from clusterops.errors import InputError, NotFoundError
from clusterops.slurm import parse
from clusterops.slurm.parse import JobInfo
from clusterops.protocol import job_dir_for

FIX = Path(__file__).parent / "fixtures" / "slurm"
ME = pwd.getpwuid(os.getuid()).pw_name


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv(jobs.REGISTRY_ENV, str(tmp_path / "registry"))
    return tmp_path / "registry"


class FakeSlurm:
    def __init__(self, infos):
        self.infos = {str(i.job_id): i for i in infos}

    def job(self, jid):
        if str(jid) not in self.infos:
            raise NotFoundError(f"job {jid} not found")
        return self.infos[str(jid)]

    def jobs(self, ids=None):
        return list(self.infos.values())


def info(jid, *, user=ME, command="", state="RUNNING", category="running", end=None):
    return JobInfo(job_id=jid, name="train", state=state, category=category, user=user, command=command,
                   end_time=end)


def spec_beside(script: Path, **sup) -> dict:
    spec = {"name": "train", "log_dir": str(script.parent), "supervise": dict(sup)}
    Path(str(script) + ".supervise.json").write_text(json.dumps(spec))
    return spec


def test_owner_and_script_parsed_from_every_recorded_version():
    for version in ("22.05", "24.11", "25.11"):
        text = (FIX / version / "scontrol_jobs.txt").read_text()
        found = parse.parse_scontrol_jobs(text)
        assert found and all(j.user == "root" for j in found), version
        js = parse.parse_squeue_json((FIX / version / "squeue.json").read_text())
        assert js and all(j.user == "root" for j in js) and any(j.command for j in js), version


def test_the_submission_record_finds_the_directory_by_the_supervisors_rule(tmp_path, registry):
    script = tmp_path / "train.sbatch"
    spec = {"name": "train", "log_dir": str(tmp_path), "supervise": {}}
    jobs.record_submission(42, str(script), str(script) + ".supervise.json", json.dumps(spec))
    rec = registry / "42.json"
    assert oct(rec.stat().st_mode & 0o777) == "0o600" and oct(registry.stat().st_mode & 0o777) == "0o700"
    loc = jobs.locate("42", FakeSlurm([]))
    assert loc.source == "registry" and loc.job_dir == job_dir_for(spec, "42") == tmp_path / "train-42"
    assert loc.ckpt_dir == tmp_path / "train-42" / "ckpt"


def test_without_a_record_the_jobs_own_script_leads_to_its_spec(tmp_path):
    script = tmp_path / "run.sbatch"
    spec_beside(script, job_dir=str(tmp_path / "jd"), ckpt_dir=str(tmp_path / "ck"))
    loc = jobs.locate(7, FakeSlurm([info(7, command=str(script))]))
    assert (loc.source, loc.job_dir, loc.ckpt_dir) == ("slurm", tmp_path / "jd", tmp_path / "ck")


def test_a_job_that_is_not_supervised_is_a_one_line_error(tmp_path):
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\n")
    for slurm, jid, words in ((FakeSlurm([]), "9", "Slurm no longer knows it"),
                              (FakeSlurm([info(9, command=str(plain))]), "9", "no readable clusterops spec"),
                              (FakeSlurm([]), "9x", "must be a Slurm job id")):
        with pytest.raises(InputError) as e:
            jobs.locate(jid, slurm)
        assert words in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2


def test_another_users_job_is_refused_unless_root(tmp_path, monkeypatch):
    script = tmp_path / "run.sbatch"
    spec_beside(script)
    slurm = FakeSlurm([info(5, user="somebody-else", command=str(script))])
    monkeypatch.setattr(jobs, "_is_admin", lambda s: False)
    with pytest.raises(InputError, match="somebody-else's: only its owner or an administrator"):
        jobs.locate(5, slurm)
    monkeypatch.setattr(jobs, "_is_admin", lambda s: True)
    assert jobs.locate(5, slurm).source == "slurm"


def rec(event, t, **kw):
    return {"event": event, "t": t, **kw}


def test_summary_step_rate_time_left_restarts_and_nodes_dropped():
    loc = jobs.Located("11", Path("/j"), Path("/j/ckpt"), None, None, "registry")
    records = [rec("start", 0.0), rec("launch", 1.0, attempt=0),
               rec("progress", 10.0, step=5), rec("progress", 20.0, step=15),
               rec("step_exit", 21.0, cause="rank_killed"), rec("node_bad", 21.5, node="node3"),
               rec("restart", 22.0), rec("launch", 23.0, attempt=1),
               rec("progress", 30.0, step=12), rec("progress", 40.0, step=32)]
    st = jobs.summarize(loc, records, info(11, end=1040.0), now=1000.0,
                        latest={"path": "/j/ckpt/step_30", "step": 30})
    assert st.step == 32 and st.steps_per_s == pytest.approx(2.0)     # the current launch's rate only
    assert st.time_left_s == 40.0 and st.steps_by_end == 112
    assert st.restarts == 1 and st.launches == 2 and "rank_killed" in st.causes
    assert st.nodes_dropped == ["node3"] and not st.finished and st.state == "RUNNING"
    lines = "\n".join(jobs.describe_status(st, now=1000.0))
    assert "2.00 steps/s" in lines and "node3" in lines and "step_30" in lines


def test_a_job_slurm_forgot_takes_its_state_from_the_timeline():
    loc = jobs.Located("12", Path("/j"), Path("/j/ckpt"), None, None, "registry")
    done = jobs.summarize(loc, [rec("launch", 1.0), rec("done", 9.0, code=0)], None, now=10.0)
    failed = jobs.summarize(loc, [rec("launch", 1.0), rec("give_up", 9.0, code=1)], None, now=10.0)
    assert (done.state, done.finished) == ("COMPLETED", True)
    assert (failed.state, failed.exit_code) == ("FAILED", 1)


def test_new_events_reads_whole_lines_from_where_it_stopped(tmp_path):
    p = tmp_path / "timeline.jsonl"
    p.write_bytes(b'{"event":"launch","t":1.0}\n{"event":"progress","t":2.0,"step":1}\n{"event":"do')
    got, off = jobs.new_events(tmp_path, 0)
    assert [r["event"] for r in got] == ["launch", "progress"]
    with open(p, "ab") as f:
        f.write(b'ne","t":3.0,"code":0}\n')
    got, off2 = jobs.new_events(tmp_path, off)
    assert [r["event"] for r in got] == ["done"] and off2 == p.stat().st_size
