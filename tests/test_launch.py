"""Job spec validation, rendering, golden scripts and the `clusterops launch` CLI (no Slurm).

Golden scripts live in tests/golden/<name>.sh; regenerate them after a deliberate
template change with `CLUSTEROPS_UPDATE_GOLDEN=1 pytest tests/test_launch.py` and
review the diff as a Slurm user would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clusterops import __version__
from clusterops import launch
from clusterops.errors import InputError
from support.fakes import RecordingSlurm

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
EXAMPLES = REPO / "examples"
GOLDEN_SPECS = sorted(p.stem for p in GOLDEN.glob("*.yaml"))


def run_cli(args, capsys):
    from clusterops.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def write_spec(tmp_path: Path, text: str, name: str = "job.yaml", script: str = "train.py") -> Path:
    (tmp_path / script).write_text("print('hello')\n")
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


BASIC = """
name: t
nodes: 2
launcher: torchrun
script: train.py
"""


def normalized(text: str) -> str:
    return text.replace(str(REPO), "/REPO").replace(f"clusterops {__version__}", "clusterops VERSION")


def bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "check.sh"
    path.write_text(text)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------
# Golden scripts and bash -n
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN_SPECS)
def test_golden_script(name, tmp_path):
    spec = launch.load_spec(GOLDEN / f"{name}.yaml")
    text = normalized(launch.render(spec))
    golden = GOLDEN / f"{name}.sh"
    if os.environ.get("CLUSTEROPS_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}: run with CLUSTEROPS_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{name}: rendered script differs from {golden}"
    bash_n(text, tmp_path)


def test_golden_covers_every_launcher():
    assert set(launch.LAUNCHERS) <= set(GOLDEN_SPECS)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_render_and_pass_bash_n(example, tmp_path):
    spec = launch.load_spec(EXAMPLES / example)
    text = launch.render(spec)
    bash_n(text, tmp_path)
    assert text.startswith("#!/bin/bash\n")


def test_examples_cover_every_launcher():
    launchers = {launch.load_spec(p).launcher for p in EXAMPLES.glob("*.yaml")}
    assert set(launch.LAUNCHERS) <= launchers


def test_fragile_parts_are_in_every_launcher_script():
    for name in launch.LAUNCHERS:
        text = launch.render(launch.load_spec(GOLDEN / f"{name}.yaml"))
        assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
        assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in text
        assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text
        assert re.search(r"^srun --kill-on-bad-exit=1 --wait=\d+ ", text, re.M)
        assert "%x-%j-%N-%n.out' --open-mode=append" in text or "%x-%j-%N-%n.out --open-mode=append" in text
        assert "#SBATCH --open-mode=append\n" in text  # a requeued job keeps its old log
        assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", text, re.M)
        assert "trap '_forward USR1' USR1" in text
        # srun in the background, and `wait $pid`: a bare `wait` would return 0.
        assert re.search(r"&\nstep_pid=\$!\n", text)
        assert 'wait "$step_pid" || rc=$?' in text
        # Per-node values only inside the single-quoted per-node body.
        body = text.split("bash -c '", 1)[1].split("\n    ' ", 1)[0]
        if name != "srun":
            assert '"$SLURM_NODEID"' in body
            assert 'trap "" USR1' in body
        else:
            assert 'RANK="$SLURM_PROCID"' in body
        # ...and never expanded by the batch shell (that would give every node node 0's value).
        batch_part = text.split("bash -c '", 1)[0]
        assert "SLURM_NODEID" not in batch_part and "SLURM_PROCID" not in batch_part


def test_torchrun_script_details():
    spec = launch.load_spec(GOLDEN / "torchrun.yaml")
    text = launch.render(spec)
    assert "#SBATCH --nodes=16\n" in text
    assert "#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --gpus-per-node=8\n" in text
    assert "#SBATCH --exclusive\n" in text
    assert "#SBATCH --exclude=gpu[007,100-103]\n" in text
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --signal=B:USR1@900\n" in text
    assert "--nproc-per-node=8" in text
    assert "--lr 3e-4" in text  # literal, not 0.0003
    assert "'first try; really'" in text


def test_chain_container_and_extra_args():
    ds = launch.render(launch.load_spec(GOLDEN / "deepspeed.yaml"))
    assert "#SBATCH --array=1-3%1\n" in ds
    assert 'export CLUSTEROPS_CHAIN_LINK="${SLURM_ARRAY_TASK_ID:-1}" CLUSTEROPS_CHAIN_LENGTH=3' in ds
    assert '#SBATCH "--comment=bert chain"\n' in ds
    assert "#SBATCH --mail-type=END,FAIL\n" in ds
    acc = launch.render(launch.load_spec(GOLDEN / "accelerate.yaml"))
    assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in acc
    assert "--container-mounts=/shared:/shared" in acc
    assert "MASTER_PORT=29500\n" in acc
    assert "--multi_gpu" in acc and "--num_processes=8" in acc


def test_supervise_script(tmp_path):
    spec = launch.load_spec(GOLDEN / "supervise.yaml")
    text = launch.render(spec)
    assert "#SBATCH --no-kill\n" in text
    assert "#SBATCH --nodes=5\n" in text  # 4 + 1 spare
    assert "#SBATCH --requeue\n" in text  # the supervisor requeues itself
    last = text.rstrip("\n").splitlines()[-1]
    assert last.startswith("exec clusterops supervise --spec-json '")
    assert "srun" not in text.split("exec clusterops", 1)[0].split("# ---- setup", 1)[1]
    # Run it with a stand-in `clusterops` that dumps its argv: the JSON survives bash.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stand_in = bindir / "clusterops"
    stand_in.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stand_in.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(text.replace("\nsource /shared/envs/llm/bin/activate\n", "\n:\n"))
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env=dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}"))
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert argv[:2] == ["supervise", "--spec-json"]
    rebuilt = launch.JobSpec.from_dict(json.loads(argv[2]))
    assert rebuilt == spec
    sup = rebuilt.supervise_dict
    assert sup["spare_nodes"] == 1 and sup["min_nodes"] == 3 and sup["preflight"] == "deep"
    assert sup["ckpt_dir"] == "/shared/ckpt/resilient"
    assert "max_restarts" not in sup  # unset keys keep the supervisor's own defaults


# ---------------------------------------------------------------------------------
# Spec parsing and validation
# ---------------------------------------------------------------------------------


def test_defaults_and_resolved_paths(tmp_path):
    spec = launch.load_spec(write_spec(tmp_path, BASIC))
    assert spec.workdir == str(tmp_path)
    assert spec.log_dir == str(tmp_path / "logs")
    assert spec.script == str(tmp_path / "train.py")
    assert spec.signal_lead_s == 600 and spec.requeue is False and spec.chain == 1
    assert spec.procs_per_node == 1 and spec.world_size == 2 and spec.tasks_per_node == 1


@pytest.mark.parametrize("extra,expect", [
    ("gpus_per_node: 8", 8),
    ("gpus_per_node: 8\nnproc_per_node: 2", 2),
    ("cpus_per_task: 4", 4),          # torchrun without GPUs: one rank per CPU
    ("", 1),
])
def test_nproc_per_node(tmp_path, extra, expect):
    spec = launch.load_spec(write_spec(tmp_path, BASIC + extra + "\n"))
    assert spec.procs_per_node == expect


def test_srun_launcher_tasks_per_rank(tmp_path):
    spec = launch.load_spec(write_spec(tmp_path, BASIC.replace("torchrun", "srun") + "cpus_per_task: 4\n"))
    assert spec.procs_per_node == 1 and spec.tasks_per_node == 1  # cpus are per rank here
    spec = launch.load_spec(write_spec(tmp_path, BASIC.replace("torchrun", "srun") + "gpus_per_node: 4\n"))
    assert spec.tasks_per_node == 4 and spec.world_size == 8


@pytest.mark.parametrize("text,seconds", [
    ("90", 5400), ("5:30", 330), ("1:30:00", 5400), ("100:00:00", 360000), ("2-12", 216000),
    ("1-2:03", 93780), ("1-0:0:10", 86410), ("UNLIMITED", None), ("infinite", None),
])
def test_slurm_time_formats(text, seconds):
    assert launch.parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["0", "1:60:00", "abc", "1-24", "-5", "1:2:3:4", "1.5", ""])
def test_bad_slurm_times(text):
    with pytest.raises(ValueError):
        launch.parse_slurm_time(text)


def test_yaml_sexagesimal_and_literal_scalars(tmp_path):
    spec = launch.load_spec(write_spec(tmp_path, BASIC + textwrap.dedent("""
        time: 1:30:00
        account: 0123
        args: [--lr, 1e-3, --flag, yes, 010]
        env:
          DEBUG: on
          RATIO: 1:2
    """)))
    assert spec.time == "1:30:00" and spec.time_limit_s == 5400
    assert spec.account == "0123"
    assert spec.args == ("--lr", "1e-3", "--flag", "yes", "010")
    assert spec.env_dict == {"DEBUG": "on", "RATIO": "1:2"}


def test_overrides(tmp_path):
    path = write_spec(tmp_path, BASIC + "supervise:\n  hang_timeout_s: 60\n")
    spec = launch.load_spec(path, ["nodes=3", "supervise.spare_nodes=1", "env.FOO=a b",
                                   "args=[--lr, 1e-3]", "time=0:20:00", "exclusive=true"])
    assert spec.nodes == 3 and spec.alloc_nodes == 4
    assert spec.supervise_dict["spare_nodes"] == 1 and spec.supervise_dict["hang_timeout_s"] == 60
    assert spec.env_dict == {"FOO": "a b"}
    assert spec.args == ("--lr", "1e-3") and spec.time == "0:20:00" and spec.exclusive is True


def test_round_trip(tmp_path):
    for name in GOLDEN_SPECS:
        spec = launch.load_spec(GOLDEN / f"{name}.yaml")
        data = json.loads(json.dumps(spec.to_dict()))
        again = launch.JobSpec.from_dict(data)
        assert again == spec, name
        assert launch.render(again) == launch.render(spec)


def test_signal_lead_defaults_and_limits(tmp_path):
    spec = launch.load_spec(write_spec(tmp_path, BASIC + "time: 10\n"))
    assert spec.signal_lead_s == 300  # the 600 s default would not fit a 10 min job
    spec = launch.load_spec(write_spec(tmp_path, BASIC + "signal_lead_s: 0\n"))
    assert "--signal" not in launch.render(spec)
    with pytest.raises(InputError, match=r"job.yaml:\d+: signal_lead_s: 600 s is not shorter"):
        launch.load_spec(write_spec(tmp_path, BASIC + "time: 10\nsignal_lead_s: 600\n"))


# Each case: extra spec text (or a replacement), the expected one-line message.
BAD_SPECS = [
    ("nodes: 0", r"job.yaml:2: nodes: must be an integer from 1 to 100000, got 0"),
    ("nodes: two", r"job.yaml:2: nodes: must be an integer"),
    ("time: 1:75:00", r"job.yaml:\d+: time: minutes field 75 out of range"),
    ("time: soon", r"job.yaml:\d+: time: 'soon' is not a Slurm time"),
    ("launcher: torchrum", r"job.yaml:3: launcher: unknown launcher 'torchrum' .*did you mean 'torchrun'"),
    ("script: missing.py", r"job.yaml:4: script: .*missing.py: no such file"),
    ("script: .", r"job.yaml:4: script: .*: is a directory"),
    ("gpus_per_nod: 8", r"job.yaml:\d+: gpus_per_nod: unknown key \(did you mean 'gpus_per_node'\?\)"),
    ("nodes: 2\nnodes: 3", r"job.yaml:\d+: nodes: duplicate key"),
    ("name: \"a\\nb\"", r"job.yaml:\d+: name: must not contain control characters"),
    ("name: a/b", r"job.yaml:\d+: name: must not contain '/'"),
    ("exclude: \"node[1-\"", r"job.yaml:\d+: exclude: not a valid hostlist"),
    ("env: {\"1BAD\": x}", r"job.yaml:\d+: env.1BAD: not a valid environment variable name"),
    ("env: [a]", r"job.yaml:\d+: env: must be a mapping"),
    ("args: --lr", r"job.yaml:\d+: args: must be a list"),
    ("mem: lots", r"job.yaml:\d+: mem: must be a size"),
    ("chain: 0", r"job.yaml:\d+: chain: must be an integer from 1"),
    ("exclusive: maybe", r"job.yaml:\d+: exclusive: must be true or false"),
    ("sbatch_args: [mail]", r"job.yaml:\d+: sbatch_args.0: each item must be one long option"),
    ("supervise: {spare_node: 1}", r"job.yaml:\d+: supervise.spare_node: unknown key \(did you mean 'spare_nodes'\?\)"),
    ("supervise: {min_nodes: 9}", r"job.yaml:\d+: supervise.min_nodes: must be an integer from 1 to 2, got 9"),
    ("supervise: {spare_nodes: -1}", r"job.yaml:\d+: supervise.spare_nodes: must be an integer from 0 to 100000, got -1"),
    ("supervise: {hang_timeout_s: 0}", r"job.yaml:\d+: supervise.hang_timeout_s: must be > 0"),
    ("supervise: {stop_timeout_s: 700}", r"job.yaml:\d+: supervise.stop_timeout_s: 700 s leaves no time"),
    ("supervise: {drain_bad_nodes: 1}", r"job.yaml:\d+: supervise.drain_bad_nodes: must be true or false"),
    ("supervise: 3", r"job.yaml:\d+: supervise: must be a mapping"),
    ("nodes: [1", r"job.yaml:\d+: YAML error"),
]


def _replace_or_add(base: str, extra: str) -> str:
    """BASIC with the line of extra's first key replaced by extra, or extra appended."""
    key = extra.split(":", 1)[0]
    lines = base.strip().splitlines()
    if any(ln.startswith(key + ":") for ln in lines):
        lines = [extra if ln.startswith(key + ":") else ln for ln in lines]
    else:
        lines.append(extra)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("extra,message", BAD_SPECS, ids=[b[0].split(":")[0] + str(i) for i, b in enumerate(BAD_SPECS)])
def test_bad_spec_exit_2_one_line(extra, message, tmp_path, capsys):
    path = write_spec(tmp_path, _replace_or_add(BASIC, extra))
    code, out, err = run_cli(["launch", "submit", str(path)], capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("Error: ")
    assert re.search(message, lines[0]), lines[0]
    assert out == ""
    assert not (tmp_path / "logs").exists()  # nothing written, so nothing submitted


def test_missing_required_key(tmp_path, capsys):
    path = write_spec(tmp_path, "name: t\nnodes: 2\nlauncher: torchrun\n")
    code, out, err = run_cli(["launch", "render", str(path)], capsys)
    assert code == 2
    assert err.strip() == f"Error: {path}: script: required key missing (required: name, nodes, launcher, script)"


def test_missing_and_bad_files(tmp_path, capsys):
    code, _, err = run_cli(["launch", "render", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "no such job spec file" in err
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    code, _, err = run_cli(["launch", "render", str(tmp_path / "list.yaml")], capsys)
    assert code == 2 and "list.yaml:1: a job spec must be a mapping" in err
    (tmp_path / "empty.yaml").write_text("")
    code, _, err = run_cli(["launch", "render", str(tmp_path / "empty.yaml")], capsys)
    assert code == 2 and "empty job spec" in err


def test_bad_override(tmp_path, capsys):
    path = write_spec(tmp_path, BASIC)
    code, _, err = run_cli(["launch", "render", str(path), "--set", "nodes=0"], capsys)
    assert code == 2 and err.strip() == "Error: --set: nodes: must be an integer from 1 to 100000, got 0"
    code, _, err = run_cli(["launch", "render", str(path), "--set", "nodes"], capsys)
    assert code == 2 and "expected key=value" in err
    code, _, err = run_cli(["launch", "render", str(path), "--set", "supervise.spare_nods=1"], capsys)
    assert code == 2 and "did you mean 'spare_nodes'" in err


# ---------------------------------------------------------------------------------
# Templates: site overrides, listing, failures
# ---------------------------------------------------------------------------------


def test_site_template_overrides_and_adds(tmp_path, capsys, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "torchrun.sh.j2").write_text(
        '{% extends "base.sh.j2" %}\n{% block node_command %}\n    site-torchrun {{ spec.script|q }} &\n{% endblock %}\n')
    (site / "mpirun.sh.j2").write_text(
        '{% extends "base.sh.j2" %}\n{% block node_command %}\n    mpirun {{ spec.script|q }} &\n{% endblock %}\n')
    path = write_spec(tmp_path, BASIC)
    code, out, _ = run_cli(["launch", "render", str(path), "--templates", str(site)], capsys)
    assert code == 0 and "site-torchrun" in out and out.startswith("#!/bin/bash")
    code, out, _ = run_cli(["launch", "render", str(path), "--set", "launcher=mpirun", "--templates", str(site)], capsys)
    assert code == 0 and "    mpirun " in out
    # Without the site directory the added launcher is unknown (line named).
    code, _, err = run_cli(["launch", "render", str(path), "--set", "launcher=mpirun"], capsys)
    assert code == 2 and "launcher: unknown launcher 'mpirun'" in err
    # The environment variable works too, after --templates.
    monkeypatch.setenv("CLUSTEROPS_TEMPLATES", str(site))
    code, out, _ = run_cli(["launch", "render", str(path)], capsys)
    assert code == 0 and "site-torchrun" in out
    code, out, _ = run_cli(["launch", "templates", "--json"], capsys)
    data = json.loads(out)
    by_name = {t["name"]: t for t in data["templates"]}
    assert by_name["torchrun"]["origin"] == "CLUSTEROPS_TEMPLATES"
    assert by_name["torchrun"]["shadows"] == [str(launch.builtin_template_dir() / "torchrun.sh.j2")]
    assert by_name["mpirun"]["launcher"] and by_name["srun"]["origin"] == "built-in"
    code, out, _ = run_cli(["launch", "templates"], capsys)
    assert code == 0 and "shadows" in out and "(built-in)" in out


@pytest.mark.parametrize("body,message", [
    ('{% extends "base.sh.j2" %}\n{% block node_command %}\n  {{ spec.no_such_key }}\n{% endblock %}\n',
     r"torchrun.sh.j2:3: template error: .*no_such_key"),
    ('{% extends "base.sh.j2" %}\n{% block node_command %}\n  {% if %}\n{% endblock %}\n',
     r"torchrun.sh.j2:3: template syntax error"),
    ('{% extends "nothere.sh.j2" %}\n', r"torchrun.sh.j2:1: template error: 'nothere.sh.j2' not found"),
])
def test_template_that_fails_to_render(body, message, tmp_path, capsys):
    site = tmp_path / "site"
    site.mkdir()
    (site / "torchrun.sh.j2").write_text(body)
    path = write_spec(tmp_path, BASIC)
    code, out, err = run_cli(["launch", "submit", str(path), "--templates", str(site)], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "logs").exists()


def test_missing_templates_dir(tmp_path, capsys):
    path = write_spec(tmp_path, BASIC)
    code, _, err = run_cli(["launch", "render", str(path), "--templates", str(tmp_path / "none")], capsys)
    assert code == 2 and "no such templates directory" in err


def test_quoting_filters():
    assert launch.shell_quote("a b") == "'a b'"
    assert launch.shell_quote("it's") == "'it'\"'\"'s'"
    assert launch.sbatch_quote("node[1-4]") == "node[1-4]"
    assert launch.sbatch_quote('a "b" #c \\d') == '"a \\"b\\" #c \\\\d"'
    with pytest.raises(ValueError):
        launch.sbatch_quote("a\nb")
    with pytest.raises(ValueError):
        launch.shell_quote("a\0b")


# ---------------------------------------------------------------------------------
# render / submit commands
# ---------------------------------------------------------------------------------


def test_render_to_file_and_dry_run(tmp_path, capsys):
    path = write_spec(tmp_path, BASIC)
    out_file = tmp_path / "job.sh"
    code, out, _ = run_cli(["launch", "render", str(path), "-o", str(out_file)], capsys)
    assert code == 0 and out == "" and out_file.read_text().startswith("#!/bin/bash")
    assert os.access(out_file, os.X_OK)
    code, out, _ = run_cli(["launch", "submit", str(path), "--dry-run", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["dry_run"] and data["job_id"] is None and data["script"].startswith("#!")
    code, out, err = run_cli(["launch", "submit", str(path), "--dry-run"], capsys)
    assert code == 0 and out.startswith("#!/bin/bash") and "dry run" in err
    assert not (tmp_path / "logs").exists()


def test_submit_writes_script_in_log_dir(tmp_path):
    spec = launch.load_spec(write_spec(tmp_path, BASIC))
    slurm = RecordingSlurm()
    result = launch.submit(spec, slurm)
    assert result.job_id == 4242
    assert Path(result.script_path).parent == tmp_path / "logs"
    assert Path(result.script_path).read_text() == result.script == slurm.submitted[0]
    assert result.to_dict()["dry_run"] is False


def test_failed_submit_leaves_no_script(tmp_path):
    from clusterops.errors import ClusteropsError

    spec = launch.load_spec(write_spec(tmp_path, BASIC))
    with pytest.raises(ClusteropsError):
        launch.submit(spec, RecordingSlurm(fail=ClusteropsError("sbatch: error: invalid partition")))
    assert list((tmp_path / "logs").iterdir()) == []


def test_help_documents_commands(capsys):
    for cmd in (["launch", "--help"], ["launch", "render", "--help"], ["launch", "submit", "--help"],
                ["launch", "templates", "--help"]):
        code, out, _ = run_cli(cmd, capsys)
        assert code == 0 and "Usage:" in out


def test_docs_tables_are_generated_from_the_schema():
    # docs/launch.md and docs/supervisor.md carry the key tables made from the one table in
    # clusterops/schema.py; `python -m clusterops.schema --write .` regenerates them.
    from clusterops import schema

    assert schema.sync_docs(REPO) == []
    doc = (REPO / "docs" / "launch.md").read_text()
    for f in schema.JOB_SPEC.fields + schema.SUPERVISE.fields:
        assert f"| `{f.name}` |" in doc, f.name


def test_docs_drift_is_caught(tmp_path):
    from clusterops import schema

    for rel in schema.DOC_TABLES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    doc = tmp_path / "docs" / "launch.md"
    doc.write_text(doc.read_text().replace("| `max_restarts` | int [0, 100000] | 5 |",
                                           "| `max_restarts` | int [0, 100000] | 7 |"))
    assert schema.sync_docs(tmp_path) == ["docs/launch.md: schema:supervise"]
    assert schema.sync_docs(tmp_path, write=True) == ["docs/launch.md: schema:supervise"]
    assert schema.sync_docs(tmp_path) == []


def test_job_spec_dataclass_matches_the_table():
    # JobSpec holds one attribute per key of the table, with the table's plain defaults.
    import dataclasses

    from clusterops import schema

    fields = {f.name: f for f in dataclasses.fields(launch.JobSpec) if f.name != "source"}
    assert list(fields) == [f.name for f in schema.JOB_SPEC.fields]
    for f in schema.JOB_SPEC.fields:
        if f.default is not None:
            assert fields[f.name].default == f.default, f.name
    assert launch.REQUIRED_KEYS == ("name", "nodes", "launcher", "script")


@pytest.mark.parametrize("extra,multi_gpu", [
    ("launcher_args: [--mixed_precision=bf16]", True),
    ("launcher_args: [--use_fsdp]", False),       # a mode of its own: no --multi_gpu next to it
    ("nodes: 1", False),                          # one process: accelerate refuses --multi_gpu
])
def test_accelerate_multi_gpu_flag(tmp_path, extra, multi_gpu):
    text = BASIC.replace("torchrun", "accelerate")
    if extra.startswith("nodes"):
        text = text.replace("nodes: 2", extra)
    else:
        text += extra + "\n"
    spec = launch.load_spec(write_spec(tmp_path, text))
    assert ("--multi_gpu" in launch.render(spec)) is multi_gpu


def test_notify_urls_are_checked_and_reach_the_supervisor(tmp_path):
    """`notify:` takes http(s) webhook URLs (a bad one names its line and index, exit 2) and
    travels in the supervised script's spec JSON to `clusterops supervise`."""
    bad = write_spec(tmp_path, BASIC + "supervise: true\nnotify: [https://hooks.example/x, 'ftp://nope']\n")
    with pytest.raises(InputError, match=r"job.yaml:\d+: notify.1: must be an http:// or https:// URL"):
        launch.load_spec(bad)
    good = write_spec(tmp_path, BASIC + "supervise: true\nnotify: [https://hooks.example/x]\n", name="ok.yaml")
    spec = launch.load_spec(good)
    assert spec.notify == ("https://hooks.example/x",)
    assert '"notify":["https://hooks.example/x"]' in launch.render(spec)


# ---------------------------------------------------------------------------------
# The kernel's limits: a script whose command could not start is refused (issue 18)
# ---------------------------------------------------------------------------------

# A stand-in `clusterops` that reports how the supervisor was called, reading --spec-file.
SPEC_STAND_IN = """#!{python}
import json, sys
argv = sys.argv[1:]
spec = None
if argv[:2] == ["supervise", "--spec-file"]:
    spec = json.load(open(argv[2]))
elif argv[:2] == ["supervise", "--spec-json"]:
    spec = json.loads(argv[2])
print(json.dumps({{"argv": argv[:2], "spec": spec}}))
"""


def run_with_stand_in(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    stand_in = bindir / "clusterops"
    stand_in.write_text(SPEC_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    return subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env=dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}"))


SUPERVISED = BASIC + """
log_dir: logs
supervise:
  preflight: false
"""


def test_render_refuses_an_argument_over_max_arg_strlen(tmp_path, capsys):
    big = "x" * launch.MAX_ARG_STRLEN          # with its NUL, one byte over the kernel's limit
    spec = write_spec(tmp_path, BASIC + f"args:\n  - --small\n  - {big}\n")
    code, out, err = run_cli(["launch", "render", str(spec)], capsys)
    assert code == 2 and out == "", err
    assert f"{spec}:" in err and "args.1:" in err and "MAX_ARG_STRLEN" in err and len(err.splitlines()) == 1, err
    # The largest value that fits is accepted.
    ok = write_spec(tmp_path, BASIC + f"args:\n  - {'x' * (launch.MAX_ARG_STRLEN - 1)}\n", name="ok.yaml")
    assert launch.render(launch.load_spec(ok))


def test_render_refuses_an_env_value_over_max_arg_strlen_naming_it(tmp_path, capsys):
    spec = write_spec(tmp_path, BASIC + f"env:\n  SMALL: '1'\n  BIG: {'y' * launch.MAX_ARG_STRLEN}\n")
    code, out, err = run_cli(["launch", "render", str(spec)], capsys)
    assert code == 2 and out == ""
    assert re.search(rf"^Error: {re.escape(str(spec))}:7: env\.BIG: {launch.MAX_ARG_STRLEN + 4} bytes", err), err
    # Through --set too (and submit refuses before writing anything).
    code, _, err = run_cli(["launch", "submit", str(write_spec(tmp_path, BASIC, name="b.yaml")), "--dry-run",
                            "--set", f"env.HUGE={'z' * launch.MAX_ARG_STRLEN}"], capsys)
    assert code == 2 and "env.HUGE:" in err and "--set" in err, err
    assert not (tmp_path / "logs").exists()


def test_arguments_and_environment_over_arg_max_are_refused(tmp_path):
    each = 100_000
    n = launch.arg_max_bytes() // each + 1
    script = str(write_spec(tmp_path, BASIC).parent / "train.py")
    data = {"name": "t", "nodes": 1, "launcher": "torchrun", "script": script,
            "args": ["a" * 1000] * 3, "env": {f"V{i}": "v" * each for i in range(n)}}
    data["env"]["V7"] = "v" * (each + 5)
    with pytest.raises(InputError) as e:
        launch.JobSpec.from_dict(data)
    msg = e.value.message
    assert "env.V7:" in msg and "ARG_MAX" in msg and f"largest is env.V7 ({each + 8} bytes)" in msg, msg
    # The limit is the kernel's less a reserve for what Slurm adds: just under it passes.
    kw = {"env": (("A", "a" * 1000),), "args": ("b",)}
    assert launch.exec_limit_problem(kw, arg_max=200 << 10) is None
    path, why = launch.exec_limit_problem({"env": (("A", "a" * 100_000),)}, arg_max=200 << 10)
    assert path == ("env", "A") and "ARG_MAX" in why


def big_supervised_spec(tmp_path: Path) -> Path:
    # Three values of 60 KB: each is fine, but the resolved spec (one JSON argument on the
    # exec line) would be 180 KB, over the kernel's 128 KiB for one argument.
    env = "".join(f"  BLOB{i}: {'b' * 60_000}\n" for i in range(3))
    return write_spec(tmp_path, SUPERVISED + "env:\n" + env, name="big.yaml")


def test_large_supervised_spec_goes_to_a_file_beside_the_script(tmp_path, capsys):
    spec = big_supervised_spec(tmp_path)
    # To standard output there is no file to put it in: refused, naming supervise.
    code, out, err = run_cli(["launch", "render", str(spec)], capsys)
    assert code == 2 and out == "" and "supervise:" in err and "-o FILE" in err, err
    # With -o it goes to FILE.supervise.json (0600), and the script's exec line names it.
    script = tmp_path / "out" / "job.sbatch"
    script.parent.mkdir()
    code, out, err = run_cli(["launch", "render", str(spec), "-o", str(script)], capsys)
    assert code == 0, err
    spec_file = Path(str(script) + launch.SPEC_FILE_SUFFIX)
    assert spec_file.stat().st_mode & 0o777 == 0o600 and script.stat().st_mode & 0o777 == 0o755
    last = script.read_text().rstrip("\n").splitlines()[-1]
    assert last == f"exec clusterops supervise --spec-file {spec_file}", last
    assert max(len(line) for line in script.read_text().splitlines()) < 61_000
    # Run it: the supervisor starts (no E2BIG) and reads back the spec it was rendered from.
    done = run_with_stand_in(script, tmp_path)
    assert done.returncode == 0, done.stderr[-500:]
    got = json.loads(done.stdout)
    assert got["argv"] == ["supervise", "--spec-file"]
    assert launch.JobSpec.from_dict(got["spec"]) == launch.load_spec(spec)


def test_submit_writes_script_and_spec_file_or_neither(tmp_path):
    from clusterops.errors import ClusteropsError

    spec = launch.load_spec(big_supervised_spec(tmp_path))

    class Refusing:
        def show_config(self):      # no expedited requeue: the spec is submitted as written
            return "SLURM_VERSION = 22.05.8\n"

        def submit(self, path):
            assert Path(path).is_file() and Path(path + launch.SPEC_FILE_SUFFIX).is_file()
            raise ClusteropsError("sbatch: error: invalid partition")

    class Accepting(Refusing):
        def submit(self, path):
            return 42

    with pytest.raises(ClusteropsError):
        launch.submit(spec, Refusing())
    assert list(Path(spec.log_dir).iterdir()) == []      # nothing half-done
    dry = launch.submit(spec, None, dry_run=True)
    assert dry.spec_file and not Path(dry.spec_file).exists() and f"--spec-file {dry.spec_file}" in dry.script
    done = launch.submit(spec, Accepting())
    assert done.job_id == 42 and done.spec_file == done.script_path + launch.SPEC_FILE_SUFFIX
    assert Path(done.spec_file).stat().st_mode & 0o777 == 0o600
    assert launch.JobSpec.from_dict(json.loads(Path(done.spec_file).read_text())) == spec
    assert sorted(p.name for p in Path(spec.log_dir).iterdir()) == sorted(
        [Path(done.script_path).name, Path(done.spec_file).name])
    # An unsupervised job has no spec file.
    plain = launch.submit(launch.load_spec(write_spec(tmp_path, BASIC, name="p.yaml")), Accepting())
    assert plain.spec_file is None and "--spec-file" not in plain.script
