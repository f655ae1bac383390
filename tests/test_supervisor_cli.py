"""Supervisor plumbing pieces that need no cluster: heartbeats, the timeline
file and its chart, the `job timeline` and `supervise` commands' input handling."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from clusterops.supervisor import timeline as tl
from clusterops.cli import cli

def _timeline(tmp_path):
    t = [1000.0]
    w = tl.Timeline(tmp_path, job_id="7", incarnation=0, clock=lambda: t[0])
    w.append("start", {"nodes": ["node1", "node2"]})
    w.append("launch", {"nodes": ["node1", "node2"], "attempt": 0, "resume_step": None, "spares": []})
    for step in (5, 10, 15):
        t[0] += 2
        w.append("progress", {"step": step, "max_step": step})
    w.append("checkpoint", {"step": 10})
    t[0] += 1
    w.append("step_exit", {"returncode": 137, "cause": "rank_killed", "blamed": ["node2"],
                           "failures": [{"node": "node2", "rank": 1, "reason": "Killed"}]})
    w.append("restart", {"cause": "rank_killed", "restart": 1, "resume_step": 10})
    w.append("launch", {"nodes": ["node1", "node2"], "attempt": 1, "resume_step": 10, "spares": []})
    t[0] += 5
    w.append("progress", {"step": 20, "max_step": 20})
    w.append("done", {"code": 0, "reason": "training finished"})
    return tmp_path


def test_timeline_roundtrip_summary_and_torn_last_line(tmp_path):
    d = _timeline(tmp_path)
    with open(d / tl.FILE_NAME, "a") as f:
        f.write('{"t": 1, "event": "trunc')        # a writer killed mid-line
    recs = tl.read(d)
    assert [r["event"] for r in recs][:2] == ["start", "launch"]
    s = tl.summary(recs)
    assert s["restarts"] == 1 and s["launches"] == 2 and s["outcome"] == "done" and s["last_step"] == 20
    text = tl.format_text(recs)
    assert "rank_killed (blamed: node2); first failure: rank 1 on node2: Killed" in text
    assert "step 5" not in text and "step 5" in tl.format_text(recs, progress=True)


def test_timeline_torn_middle_line_is_skipped_and_counted(tmp_path):
    # A crash mid-write, then a requeued incarnation appending after the torn line.
    (tmp_path / tl.FILE_NAME).write_bytes(b'{"t": 1, "event": "start"}\n{"t": 1.5, "event": "lau'
                                          b'{"t": 2, "event": "launch", "nodes": ["node1"]}\n'
                                          b'\x00\x00\x00\xff\n{"t": 3, "event": "done", "code": 0}\n')
    recs, skipped = tl.load(tmp_path)
    assert [r["event"] for r in recs] == ["start", "done"]
    assert [n for n, _ in skipped] == [2, 3]
    assert tl.read(tmp_path) == recs


def test_chart_svg_marks_faults_and_decisions(tmp_path):
    recs = tl.read(_timeline(tmp_path))
    svg = tl.render_svg(recs, title="t")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "<polyline" in svg                      # the step line
    assert 'stroke="#d22"' in svg                  # a fault marker (step_exit)
    assert 'stroke="#25c"' in svg                  # a decision marker (restart)
    assert "checkpoint step 10" in svg
    html = tl.render_html(recs, title="t")
    assert "<table>" in html and "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_job_timeline_cli_text_json_chart(tmp_path):
    d = _timeline(tmp_path)
    r = CliRunner().invoke(cli, ["job", "timeline", str(d), "--chart", str(tmp_path / "c.html")])
    assert r.exit_code == 0, r.output
    assert "2 launch(es), 1 restart(s), 0 requeue(s); outcome: done (exit 0)" in r.output
    assert (tmp_path / "c.html").read_text().startswith("<!doctype html>")
    r = CliRunner().invoke(cli, ["job", "timeline", str(d), "--json"])
    data = json.loads(r.output)
    assert data["summary"]["restarts"] == 1 and data["records"][0]["event"] == "start"


def test_job_timeline_cli_errors(tmp_path, monkeypatch, capsys):
    assert run_main(["job", "timeline", str(tmp_path)], monkeypatch) == 2
    assert "no timeline here" in capsys.readouterr().err
    _timeline(tmp_path)
    assert run_main(["job", "timeline", str(tmp_path), "--chart", str(tmp_path / "c.png")], monkeypatch) == 2
    assert "must end in .svg or .html" in capsys.readouterr().err


def run_main(args, monkeypatch, env=None):
    """Run the real entry point (main maps errors to exit codes)."""
    from clusterops.cli import main

    for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code


def test_supervise_outside_allocation_is_usage_error(tmp_path, monkeypatch, capsys):
    code = run_main(["supervise", "--job-dir", str(tmp_path), "--preflight", "none", "--", "true"], monkeypatch)
    assert code == 2
    assert "must run inside a Slurm allocation" in capsys.readouterr().err


def test_supervise_bad_inputs(tmp_path, monkeypatch, capsys):
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "1"}
    assert run_main(["supervise", "--spec-json", "{nope", "--", "true"], monkeypatch, env) == 2
    assert "--spec-json: not valid JSON" in capsys.readouterr().err
    assert run_main(["supervise", "--job-dir", str(tmp_path), "--nodes", "2", "--nodes-min", "3", "--", "true"],
                    monkeypatch, env) == 2
    assert "min_nodes" in capsys.readouterr().err
    assert run_main(["supervise", "--job-dir", str(tmp_path)], monkeypatch, env) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_policy_from_spec_keys():
    from clusterops.supervisor.config import command_from_spec, policy_kwargs_from_spec
    from clusterops.errors import InputError

    kw = policy_kwargs_from_spec({"nodes": 3, "gpus_per_node": 8, "supervise": {
        "spare_nodes": 1, "preflight": False, "hang_timeout_s": 30, "drain_bad_nodes": True}})
    assert kw == {"nodes": 3, "ranks_per_node": 8, "spare_nodes": 1, "preflight": None, "hang_timeout_s": 30.0,
                  "drain_bad_nodes": True}
    with pytest.raises(InputError, match=r"supervise.hang_timout_s: unknown key \(did you mean 'hang_timeout_s'\?\)"):
        policy_kwargs_from_spec({"nodes": 1, "supervise": {"hang_timout_s": 3}})
    assert command_from_spec({"script": "t.py", "args": ["--x", 1], "python": "py3"}) == ["py3", "t.py", "--x", "1"]
    assert command_from_spec({"script": "./run.sh"}) == ["./run.sh"]


def test_bad_drain_guard_setting_is_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    spec = json.dumps({"name": "x", "launcher": "srun", "script": str(script), "nodes": 2,
                       "supervise": {"drain_bad_nodes": True, "preflight": False}})
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "1", "CLUSTEROPS_MAX_DRAINED_FRACTION": "2"}
    job_dir = tmp_path / "job"
    assert run_main(["supervise", "--spec-json", spec, "--job-dir", str(job_dir), "--", "true"], monkeypatch, env) == 2
    assert "$CLUSTEROPS_MAX_DRAINED_FRACTION: must be between 0 and 1" in capsys.readouterr().err
    assert not job_dir.exists()


def test_supervise_spec_file_is_read_bounded_and_checked(tmp_path, monkeypatch, capsys):
    """--spec-file (what `launch submit` writes beside a supervised script): a regular file
    holding the resolved spec; a FIFO, bad JSON or both flags are exit 2 naming the file."""
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "1", "CLUSTEROPS_MAX_DRAINED_FRACTION": "2"}
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    assert run_main(["supervise", "--spec-file", str(fifo), "--", "true"], monkeypatch, env) == 2
    assert f"--spec-file {fifo}: cannot read: is a FIFO" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert run_main(["supervise", "--spec-file", str(bad), "--", "true"], monkeypatch, env) == 2
    assert f"--spec-file {bad}: not valid JSON" in capsys.readouterr().err
    assert run_main(["supervise", "--spec-file", str(bad), "--spec-json", "{}", "--", "true"], monkeypatch, env) == 2
    assert "not both" in capsys.readouterr().err
    # A good file is the spec: here its drain guard setting is checked (and refused) as from --spec-json.
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    good = tmp_path / "job.sbatch.supervise.json"
    good.write_text(json.dumps({"name": "x", "launcher": "srun", "script": str(script), "nodes": 2,
                                "supervise": {"drain_bad_nodes": True, "preflight": False}}))
    job_dir = tmp_path / "job"
    assert run_main(["supervise", "--spec-file", str(good), "--job-dir", str(job_dir), "--", "true"],
                    monkeypatch, env) == 2
    assert "$CLUSTEROPS_MAX_DRAINED_FRACTION: must be between 0 and 1" in capsys.readouterr().err
    assert not job_dir.exists()


def test_supervise_holds_stop_signals_from_its_first_line(monkeypatch):
    """`clusterops supervise` takes over what the batch script noted (and drops it from the
    environment the ranks inherit) and keeps what comes next, before any heavy import."""
    import signal

    from clusterops.cli.supervise import EARLY_SIGNALS_ENV, hold_stop_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    monkeypatch.setenv(EARLY_SIGNALS_ENV, "USR1,HUP,TERM")
    try:
        got = hold_stop_signals()
        assert got == [signal.SIGUSR1, signal.SIGTERM]      # an unknown name is no stop
        assert EARLY_SIGNALS_ENV not in os.environ
        os.kill(os.getpid(), signal.SIGUSR1)                 # the process lives on
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM]
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_supervised_script_notes_early_signals_and_hands_them_on(tmp_path):
    """The rendered batch script, run by bash for real up to its `exec`: a USR1 and a TERM
    during the setup end nothing and reach the exec'd command in $CLUSTEROPS_EARLY_SIGNALS,
    which starts with both ignored."""
    import subprocess

    from clusterops import launch

    (tmp_path / "t.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Stands in for the real command at the exec: says what it was handed, and what it ignores.
    (bin_dir / "clusterops").write_text('#!/bin/bash\necho "early=$CLUSTEROPS_EARLY_SIGNALS"\n'
                                        'grep -E "^SigIgn" /proc/self/status\n')
    (bin_dir / "clusterops").chmod(0o755)
    body = {"name": "early", "launcher": "srun", "nodes": 1, "time": "10", "script": str(tmp_path / "t.py"),
            "log_dir": str(tmp_path / "logs"), "signal_lead_s": 30,
            "setup": [f"export PATH={bin_dir}:$PATH", "kill -USR1 $$", "kill -TERM $$", "echo setup-done"],
            "supervise": {"ckpt_dir": str(tmp_path / "ckpt")}}
    import yaml

    (tmp_path / "early.yaml").write_text(yaml.safe_dump(body))
    script = launch.render(launch.load_spec(tmp_path / "early.yaml"))
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "1"})
    assert p.returncode == 0, p.stderr
    assert "setup-done" in p.stdout and "early=USR1,TERM" in p.stdout
    ignored = int(p.stdout.split("SigIgn:")[1].split()[0], 16)
    assert ignored & (1 << (signal_num("USR1") - 1)) and ignored & (1 << (signal_num("TERM") - 1))


def signal_num(name: str) -> int:
    import signal

    return int(getattr(signal, "SIG" + name))
