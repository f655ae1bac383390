"""Choosing the Slurm backend, and the pyslurm backend's pure parts (no cluster).

The backend on the real dev cluster is tested in tests/integration/test_slurm_contract.py.
"""

import pytest

from clusterops.errors import InputError
from clusterops.slurm import pyslurm_backend as pb
from clusterops.slurm.factory import connect
from clusterops.slurm.settings import SlurmSettings
from support.fakes import ScriptedRunner


def ConfigRunner(version, conf):
    """Answers `scontrol show config` with a controller of the given version (and nothing else)."""
    conf.write_text("# a slurm.conf stand-in: only its path is used\n")

    def answer(argv):
        assert argv[-3:] == ["scontrol", "show", "config"] or argv[-1] == "config", argv
        return f"Configuration data\nSLURM_VERSION = {version}\n"

    return ScriptedRunner(answer=answer, env={"SLURM_CONF": str(conf)})


def test_backend_setting_from_the_environment():
    assert SlurmSettings().backend == "auto"
    assert SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": " PySlurm "}).backend == "pyslurm"
    assert SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": "cli"}).backend == "cli"
    with pytest.raises(InputError) as e:
        SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": "slurmrestd"})
    assert str(e.value) == ("environment: Slurm settings: backend: must be one of auto, cli, pyslurm, rest, "
                            "got 'slurmrestd'")
    assert e.value.exit_code == 2


def test_cli_backend_asks_nothing(tmp_path):
    runner = ConfigRunner("22.05.8", tmp_path / "slurm.conf")
    client = connect(SlurmSettings(backend="cli"), runner=runner)
    assert client.backend == "cli" and runner.calls == []


def test_a_controller_pyslurm_was_not_built_for_keeps_the_cli(caplog, tmp_path):
    # A 22.05 controller: auto falls back to the CLI and says why; an explicit pyslurm is
    # one line, exit 2 -- whether pyslurm is missing here or built for another Slurm.
    runner = ConfigRunner("22.05.8", tmp_path / "slurm.conf")
    with caplog.at_level("INFO", logger="clusterops.slurm.pyslurm_backend"):
        client = connect(SlurmSettings(backend="auto"), runner=runner)
    assert client.backend == "cli"
    have = pb.installed_version()
    want = "is not installed" if have is None else "the controller runs 22.05.8"
    assert any(want in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(InputError) as e:
        connect(SlurmSettings(backend="pyslurm"), runner=ConfigRunner("22.05.8", tmp_path / "slurm.conf"))
    assert want in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2


def test_sbatch_header_and_args_map_to_submit_fields():
    text = ("#!/bin/bash\n"
            "# a comment\n"
            "#SBATCH --job-name='two words'\n"
            "#SBATCH --nodes=3 --ntasks-per-node=1\n"
            "#SBATCH --time=0:10:00   # ten minutes\n"
            "#SBATCH --signal=B:USR1@30\n"
            "#SBATCH --requeue\n"
            "#SBATCH -x node[1-2]\n"
            "echo hi\n"
            "#SBATCH --partition=never-read\n")
    f = pb.submit_fields(text, ["--output=/tmp/o.out", "-J", "cli-wins"], "/tmp")
    assert f == {"name": "cli-wins", "nodes": "3", "ntasks_per_node": 1, "time_limit": "0:10:00",
                 "signal": {"signal": 10, "time": 30, "batch_only": True}, "is_requeueable": True, "excluded_nodes": ["node1", "node2"],
                 "standard_output": "/tmp/o.out", "working_directory": "/tmp", "ntasks": 3}


@pytest.mark.parametrize("words", [["--mail-type=END"], ["--gpus-per-node=2"], ["-Z"], ["stray"],
                                   ["--time"], ["--signal=X:USR1@30"], ["--signal=NOPE@3"], ["--ntasks=two"]])
def test_options_not_mapped_go_through_sbatch(words):
    with pytest.raises(pb.Unmapped):
        pb.submit_fields("#!/bin/bash\ntrue\n", words, None)


def test_warn_signal_forms():
    assert pb.submit_fields("#!/bin/bash\n", ["--signal=TERM"], None)["signal"] == {"signal": 15, "time": 60}
    assert pb.submit_fields("#!/bin/bash\n", ["--signal=R:12@5"], None)["signal"] == {
        "signal": 12, "time": 5, "allow_reservation_overlap": True}


# ---------------------------------------------------------------- PyslurmSlurm, composed
class FakePyslurm:
    """The few pyslurm names PyslurmSlurm uses for nodes, with a scripted ``Nodes.load``."""

    class PyslurmError(Exception):
        pass

    def __init__(self, nodes, failures=0):
        ps = self
        self.loads, self.modified = 0, []

        class Nodes:
            def __init__(self, names):
                self.names = list(names)

            @staticmethod
            def load():
                ps.loads += 1
                if ps.loads <= failures:
                    raise ps.PyslurmError("Unable to contact slurm controller (connect failure)")
                return {n.name: n for n in nodes}

            def modify(self, change):
                ps.modified.append((self.names, change))

        self.Nodes = Nodes
        self.Node = lambda **changes: changes


def ps_node(name, state="IDLE", reason=None):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, state=state, reason=reason, reason_user=None, reason_time=None,
                           configured_gres={}, partitions=["debug"], total_cpus=2, allocated_cpus=0)


def pyslurm_client(monkeypatch, ps, outcomes=()):
    from clusterops.slurm.client import Slurm

    monkeypatch.setattr(pb, "_load", lambda conf: ps)
    runner = ScriptedRunner(outcomes)
    sleeps = []
    cli = Slurm(runner, read_attempts=3, backoff_s=0.1, sleep=sleeps.append)
    return pb.PyslurmSlurm(cli), runner, sleeps


def test_pyslurm_backend_keeps_the_shared_drain_and_resume_rules(monkeypatch):
    from clusterops.slurm import ForeignDrainError

    ps = FakePyslurm([ps_node("node1", "IDLE+DRAIN", "clusterops: health fail"),
                      ps_node("node2", "IDLE+DRAIN", "admin: bad DIMM")])
    client, runner, _ = pyslurm_client(monkeypatch, ps)
    with pytest.raises(InputError, match="one line"):
        client.drain("node1", "clusterops: a\nb")
    with pytest.raises(InputError, match="only reasons starting 'clusterops:'"):
        client.drain("node1", "bad DIMM")
    with pytest.raises(ForeignDrainError, match="node2"):
        client.resume("node[1-2]")
    assert ps.modified == []                      # nothing resumed, nothing drained
    client.resume(["node1"])
    client.drain("node1", "clusterops: health fail")
    assert ps.modified == [(["node1"], {"state": "RESUME"}),
                           (["node1"], {"state": "DRAIN", "reason": "clusterops: health fail"})]
    assert runner.calls == []                      # all of it as RPCs


def test_pyslurm_backend_reads_retry_by_the_one_rule(monkeypatch):
    from clusterops.slurm import SlurmUnavailable

    client, _, sleeps = pyslurm_client(monkeypatch, FakePyslurm([ps_node("node1")], failures=2))
    assert [n.name for n in client.nodes()] == ["node1"] and sleeps == [0.1, 0.2]
    client, _, sleeps = pyslurm_client(monkeypatch, FakePyslurm([ps_node("node1")], failures=5))
    with pytest.raises(SlurmUnavailable) as e:
        client.node("node1")
    assert str(e.value).startswith("Slurm did not answer after 3 attempts: load nodes: Unable to contact")
    assert sleeps == [0.1, 0.2]


def test_pyslurm_backend_forwards_its_list_to_the_cli_client(monkeypatch):
    client, runner, _ = pyslurm_client(monkeypatch, FakePyslurm([]), outcomes=["node1 idle\nnode2 drained\n"])
    monkeypatch.delenv("SLURM_CONF", raising=False)
    assert client.node_states() == {"node1": "idle", "node2": "drained"}
    assert runner.calls[0][-4:] == ["sinfo", "--noheader", "--Node", "--format=%N %T"]
    assert "node_states" in pb.FORWARDED_TO_CLI and client.cli.runner is runner
