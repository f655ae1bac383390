"""Scripts without the SDK: checkpoints by pattern, progress from output, the spec keys (issue 13)."""

from __future__ import annotations

import os
import textwrap

import pytest

from clusterops import launch
from clusterops.supervisor.config import plain_contract
from clusterops.errors import InputError
from clusterops.protocol import read_heartbeats
from clusterops.supervisor.run import PlainContract, ProgressReader, plain_checkpoints


def test_newest_complete_checkpoint_by_pattern(tmp_path):
    for name in ("ckpt_0000010.pt", "ckpt_0000020.pt", "ckpt_0000030.pt.tmp", ".ckpt_0000040.pt",
                 "ckpt_0000050.pt~", "other_0000060.pt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "ckpt_0000009.pt").write_bytes(b"x")        # lower step, newer file: not the newest
    found = plain_checkpoints(tmp_path, "ckpt_*.pt*")
    assert [(s, p.name) for s, _, p in found] == [(9, "ckpt_0000009.pt"), (10, "ckpt_0000010.pt"),
                                                   (20, "ckpt_0000020.pt")]
    # Directories count too (a script's own sharded format).
    (tmp_path / "step-100").mkdir()
    assert plain_checkpoints(tmp_path, "step-*")[-1][0] == 100
    assert plain_checkpoints(tmp_path / "missing", "*.pt") == []


def test_resume_args_template():
    c = PlainContract(progress_regex="step=(\\d+)", resume_args=["--resume", "{ckpt}", "--x={ckpt}"])
    assert c.resume_argv("/c/k.pt") == ["--resume", "/c/k.pt", "--x=/c/k.pt"]
    assert c.resume_argv("") == []          # nothing to resume from: the command as written
    assert c.active and not PlainContract().active


def test_progress_from_labelled_output_becomes_heartbeats(tmp_path):
    log, hb = tmp_path / "step.log", tmp_path / "hb"
    hb.mkdir()
    r = ProgressReader(r"step[= ](\d+)", log, hb, ranks=3)
    r.poll()                                 # no log yet: nothing
    assert read_heartbeats(hb) == {}
    log.write_text("0: loading\n0: step=1 loss=3\n2: step 4\n0: step=")
    r.poll()
    beats = read_heartbeats(hb)
    # Rank 2 printed its own; ranks 0 and 1 follow the newest anyone printed... rank 0 its own.
    assert {k: v[0] for k, v in beats.items()} == {0: 1, 1: 4, 2: 4}
    os.utime(hb / "rank2", (1, 1))
    with open(log, "a") as f:
        f.write("7\n1: step=5\n")           # the partial line completes: rank 0 at 7
    r.poll()
    beats = read_heartbeats(hb)
    assert {k: v[0] for k, v in beats.items()} == {0: 7, 1: 5, 2: 4}
    assert beats[2][1] == 1                  # unchanged step: not rewritten, its age is its silence


def _spec(tmp_path, supervise: str):
    (tmp_path / "t.py").write_text("")
    p = tmp_path / "job.yaml"
    p.write_text(textwrap.dedent("""
        name: p
        launcher: srun
        nodes: 1
        script: t.py
        supervise:
    """).lstrip() + textwrap.indent(textwrap.dedent(supervise).strip(), "  ") + "\n")
    return p


def test_spec_keys_are_checked(tmp_path):
    spec = launch.load_spec(_spec(tmp_path, """
        progress: {regex: 'step=(\\d+)'}
        checkpoint_glob: 'ckpt_*.pt'
        resume_args: [--resume, '{ckpt}']
    """))
    sup = spec.supervise_dict
    assert sup["progress"] == {"regex": "step=(\\d+)"} and sup["checkpoint_glob"] == "ckpt_*.pt"
    c = plain_contract(sup)
    assert (c.progress_regex, c.checkpoint_glob, c.resume_args) == ("step=(\\d+)", "ckpt_*.pt",
                                                                    ["--resume", "{ckpt}"])
    for bad, words in (("progress: {regex: 'step=\\d+'}", "supervise.progress.regex: needs a group"),
                       ("progress: {regex: 'step=(\\d+'}", "not a valid regular expression"),
                       ("progress: {regx: 'x'}", "supervise.progress.regx: unknown key"),
                       ("progress: {}", "regex: required"),
                       ("progress: step", "must be a mapping")):
        with pytest.raises(InputError) as e:
            launch.load_spec(_spec(tmp_path, bad))
        assert words in str(e.value) and "job.yaml:" in str(e.value), (bad, str(e.value))


def test_flags_give_json():
    c = plain_contract({"progress": '{"regex": "it (\\\\d+)"}', "resume_args": '["--from", "{ckpt}"]',
                         "checkpoint_glob": "*.ckpt"})
    assert (c.progress_regex, c.resume_args, c.checkpoint_glob) == ("it (\\d+)", ["--from", "{ckpt}"], "*.ckpt")
    with pytest.raises(InputError, match="--resume-args: not valid JSON"):
        plain_contract({"resume_args": "[--from"})
    with pytest.raises(InputError, match="needs a group"):
        plain_contract({"progress": {"regex": "x"}})
