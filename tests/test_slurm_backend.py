"""Choosing the Slurm backend, and the pyslurm backend's pure parts (no cluster).

The backend on the real dev cluster is tested in tests/integration/test_slurm_contract.py.
"""

import pytest

from clusterops.errors import InputError
from clusterops.runner import Completed
from clusterops.slurm import pyslurm_backend as pb
from clusterops.slurm.settings import SlurmSettings, connect


class ConfigRunner:
    """Answers `scontrol show config` with a controller of the given version."""

    def __init__(self, version, conf):
        conf.write_text("# a slurm.conf stand-in: only its path is used\n")
        self.version = version
        self.calls = []
        self.env = {"SLURM_CONF": str(conf)}

    def run(self, argv, **kw):
        self.calls.append(list(argv))
        assert argv[-3:] == ["scontrol", "show", "config"] or argv[-1] == "config", argv
        return Completed(tuple(argv), 0, f"Configuration data\nSLURM_VERSION = {self.version}\n", "", 0.01)


def test_backend_setting_from_the_environment():
    assert SlurmSettings().backend == "auto"
    assert SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": " PySlurm "}).backend == "pyslurm"
    assert SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": "cli"}).backend == "cli"
    with pytest.raises(InputError) as e:
        SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": "rest"})
    assert str(e.value) == ("environment: Slurm settings: backend: must be one of auto, cli, pyslurm, "
                            "got 'rest'")
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
    with pytest.raises(pb._Unmapped):
        pb.submit_fields("#!/bin/bash\ntrue\n", words, None)


def test_warn_signal_forms():
    assert pb.submit_fields("#!/bin/bash\n", ["--signal=TERM"], None)["signal"] == {"signal": 15, "time": 60}
    assert pb.submit_fields("#!/bin/bash\n", ["--signal=R:12@5"], None)["signal"] == {
        "signal": 12, "time": 5, "allow_reservation_overlap": True}
