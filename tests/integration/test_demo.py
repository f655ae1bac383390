"""The README's main demo (examples/demo.py) runs green on the shared dev cluster."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_heals_a_killed_rank_and_matches_uninterrupted_weights(cluster, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("clusterops_demo", REPO / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    chart = tmp_path / "timeline.svg"
    # A running cluster in --state-dir is reused and left running.
    code = demo.main(["--state-dir", str(cluster.state), "--work-dir", str(tmp_path / "work"),
                      "--chart", str(chart)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAULT: kill -9 rank 2" in out and "DEMO PASSED" in out
    assert re.search(r"goodput \d+\.\d% \([\d.]+s productive of [\d.]+s wall\); lost: .*restart [\d.]+s.*; "
                     r"restarts 1, MTTR [\d.]+s", out), out
    assert out.count("[PASS]") == 5 and "[FAIL]" not in out
    assert chart.read_text().startswith("<svg")
    assert cluster.running()
