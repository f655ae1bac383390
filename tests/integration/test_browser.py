"""The pages a person reads, opened in real headless Chromium (Debian's chromium and
chromium-driver, driven by selenium): the sweep's HTML report and a supervised job's
timeline chart render, show failing nodes and faults, load nothing from the network,
and stay readable at 2,048 nodes. Screenshots go to $CLUSTEROPS_TEST_ARTIFACTS
(default: test-artifacts/ in the repository)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.report import LARGE_FLEET, html_report

REPO = Path(__file__).resolve().parents[2]
CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")
WINDOW = (1400, 1000)


def artifacts() -> Path:
    d = Path(os.environ.get("CLUSTEROPS_TEST_ARTIFACTS") or REPO / "test-artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.fail("chromium / chromedriver not found (scripts/setup.sh installs Debian's chromium and "
                    "chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")   # selenium must not look for drivers online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--hide-scrollbars",
                # No network at all: a page that needs one shows it as failed requests.
                "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    drv = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        yield drv
    finally:
        drv.quit()


def open_page(drv, path: Path) -> list:
    """Load a file; return every URL the page requested (after its own)."""
    drv.get_log("performance")     # drop what came before
    drv.get(path.resolve().as_uri())
    assert drv.execute_script("return document.readyState") == "complete"
    urls = []
    for entry in drv.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    urls += drv.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return [u for u in urls if u != path.resolve().as_uri()]


def assert_offline(urls):
    assert [u for u in urls if not u.startswith(("file:", "data:", "about:"))] == [], "the page fetched the network"


def screenshot(drv, name: str) -> Path:
    out = artifacts() / name
    assert drv.save_screenshot(str(out))
    assert out.stat().st_size > 5000          # a real picture, not a blank page
    return out


def css(drv, selector):
    from selenium.webdriver.common.by import By

    return drv.find_elements(By.CSS_SELECTOR, selector)


def test_the_offline_check_catches_a_page_that_fetches(browser, tmp_path):
    page = tmp_path / "fetches.html"
    page.write_text('<html><body><img src="http://example.invalid/x.png"></body></html>')
    urls = open_page(browser, page)
    with pytest.raises(AssertionError):
        assert_offline(urls)


# -- the job timeline chart -----------------------------------------------------------

def _timeline():
    t, recs = 1_700_000_000.0, []
    recs.append({"t": t, "event": "launch", "job_id": "51", "incarnation": 0, "attempt": 1, "resume_step": 0})
    for i in range(1, 9):
        recs.append({"t": t + 5 * i, "event": "progress", "job_id": "51", "incarnation": 0, "step": 10 * i})
    recs += [{"t": t + 22, "event": "checkpoint", "job_id": "51", "incarnation": 0, "step": 40},
             {"t": t + 41, "event": "heartbeat_lost", "job_id": "51", "incarnation": 0, "cause": "hang"},
             {"t": t + 43, "event": "restart", "job_id": "51", "incarnation": 0, "cause": "hang"},
             {"t": t + 45, "event": "launch", "job_id": "51", "incarnation": 0, "attempt": 2, "resume_step": 40}]
    for i in range(1, 6):
        recs.append({"t": t + 45 + 5 * i, "event": "progress", "job_id": "51", "incarnation": 0, "step": 40 + 10 * i})
    recs += [{"t": t + 60, "event": "checkpoint", "job_id": "51", "incarnation": 0, "step": 70},
             {"t": t + 72, "event": "node_down", "job_id": "51", "incarnation": 0, "nodes": ["node3"]},
             {"t": t + 74, "event": "requeue", "job_id": "51", "incarnation": 0, "cause": "node lost"},
             {"t": t + 110, "event": "launch", "job_id": "51", "incarnation": 1, "attempt": 1, "resume_step": 70},
             {"t": t + 130, "event": "progress", "job_id": "51", "incarnation": 1, "step": 100},
             {"t": t + 131, "event": "done", "job_id": "51", "incarnation": 1, "code": 0}]
    return recs


def test_timeline_chart_renders_with_its_marks(browser, tmp_path):
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    (jobdir / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _timeline()))
    chart = tmp_path / "timeline.html"
    r = subprocess.run([CLUSTEROPS, "job", "timeline", str(jobdir), "--chart", str(chart)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert_offline(open_page(browser, chart))
    svg = css(browser, "svg")[0]
    assert svg.size["width"] > 600 and svg.size["height"] > 200
    steps = css(browser, "polyline.step")
    assert len(steps) == 3 and all(s.is_displayed() for s in steps)       # one line per launch
    assert len(css(browser, "rect.checkpoint")) == 2
    faults = {e.get_attribute("data-event") for e in css(browser, "line.fault")}
    assert faults == {"heartbeat_lost", "node_down"}
    decisions = {e.get_attribute("data-event") for e in css(browser, "line.decision")}
    assert {"restart", "requeue", "done"} <= decisions
    labels = " ".join(e.text for e in css(browser, "text.fault-label"))
    assert "heartbeat lost" in labels and "node down" in labels
    # The lines are drawn where a person sees them, inside the chart.
    box = browser.execute_script("return document.querySelector('line.fault').getBoundingClientRect().toJSON()")
    assert box["height"] > 100 and 0 < box["x"] < svg.size["width"]
    screenshot(browser, "timeline-chart.png")


# -- the sweep report --------------------------------------------------------------------

def _node(i, status="pass", tflops=100.0, straggler=False):
    return {"node": f"gpu{i:04d}", "status": status, "healthy": status in ("pass", "warn"),
            "detail": "" if status == "pass" else f"{status}: matmul below threshold",
            "duration_s": 1.2, "metrics": {} if tflops is None else {"matmul_tflops": tflops},
            "stragglers": ["matmul_tflops"] if straggler else []}


def _doc(nodes, guard=False):
    counts = {}
    for n in nodes:
        counts[n["status"]] = counts.get(n["status"], 0) + 1
    counts["stragglers"] = sum(1 for n in nodes if n["stragglers"])
    return {"sweep_id": "20261201T0200Z", "started": 1_764_554_400.0, "finished": 1_764_554_460.0,
            "duration_s": 60.0, "exit_code": 3 if guard else 1, "counts": counts,
            "options": {"profile": "deep", "via": "slurm", "drain": True},
            "medians": {"matmul_tflops": 100.0}, "nodes": nodes, "errors": [],
            "plan": {"guard_tripped": guard, "message": "SAFETY GUARD: too many would be drained" if guard else "",
                     "actions": []}, "applied": []}


def test_sweep_report_shows_failing_nodes(browser, tmp_path):
    nodes = [_node(1), _node(2, "fail", 40.0), _node(3, tflops=80.0, straggler=True), _node(4, "unreachable", None),
             _node(5), _node(6, "skipped", None)]
    page = tmp_path / "report.html"
    page.write_text(html_report(_doc(nodes, guard=True)))
    assert_offline(open_page(browser, page))
    bars = css(browser, "rect.bar")
    assert len(bars) == 6
    fail_bar = css(browser, 'rect.bar.fail')[0]
    assert fail_bar.is_displayed() and fail_bar.value_of_css_property("fill") == "rgb(198, 40, 40)"
    marks = [m.text for m in css(browser, "svg text.mark")]
    assert sorted(marks) == ["▼", "✗", "✗"]
    row = css(browser, 'tr[data-node="gpu0002"]')[0]
    assert row.is_displayed() and "fail" in row.text
    assert css(browser, "p.guard")[0].is_displayed()
    assert css(browser, ".median")
    screenshot(browser, "sweep-report-small.png")


def test_2048_node_report_stays_readable(browser, tmp_path):
    """2,048 nodes: the chart is sorted (lowest first) and fits the window, only problem
    nodes are named; the table lists the 12 problem nodes worst first and folds the rest."""
    import random

    rng = random.Random(7)
    nodes = [_node(i, tflops=round(rng.gauss(100, 2), 2)) for i in range(1, 2049)]
    bad = {17: "fail", 300: "fail", 1999: "fail", 512: "unreachable", 1024: "error", 2048: "fail"}
    for i, st in bad.items():
        nodes[i - 1] = _node(i, st, None if st in ("unreachable", "error") else 35.0)
    slow = [90, 777, 1500, 1800, 2000, 5]
    for i in slow:
        nodes[i - 1] = _node(i, tflops=80.0, straggler=True)
    problems = {f"gpu{i:04d}" for i in list(bad) + slow}
    page = tmp_path / "big.html"
    page.write_text(html_report(_doc(nodes)))
    assert len(nodes) > LARGE_FLEET
    assert_offline(open_page(browser, page))
    # Nothing to scroll sideways: the chart fits the window.
    assert browser.execute_script("return document.documentElement.scrollWidth") <= WINDOW[0]
    assert len(css(browser, "rect.bar")) == 2048
    named = {t.text for t in css(browser, "svg text.label")}
    assert named == problems
    # Sorted: the chart starts with the nodes without a value, then the lowest.
    first = [b.get_attribute("data-node") for b in css(browser, "rect.bar")[:6]]
    assert set(first[:2]) == {"gpu0512", "gpu1024"} and set(first[2:6]) == {f"gpu{i:04d}" for i in (17, 300, 1999, 2048)}
    rows = css(browser, "#nodes tr[data-node]")
    assert {r.get_attribute("data-node") for r in rows} == problems
    assert all(r.is_displayed() for r in rows)
    assert [r.get_attribute("data-status") for r in rows][:4] == ["fail"] * 4     # worst first
    healthy = css(browser, "#healthy-nodes tr[data-node]")
    assert len(healthy) == 2048 - 12 and not healthy[0].is_displayed()
    screenshot(browser, "sweep-report-2048.png")
    css(browser, "#healthy summary")[0].click()
    assert healthy[0].is_displayed()


@pytest.mark.integration
def test_dev_cluster_sweep_report_in_chromium(browser, cluster, tmp_path):
    """A real sweep of the 4-node dev cluster with node3 broken for real; the report's
    screenshot is the one in docs/sweep.md (CLUSTEROPS_UPDATE_DOCS=1 writes it there)."""
    from integration.test_sweep_slurm import PROFILE, BrokenScratch

    import tempfile

    short = Path(tempfile.mkdtemp(prefix="sweep-"))     # a short path: the report names the profile
    profile = short / "sweeptest.yaml"
    profile.write_text(PROFILE)
    page = tmp_path / "report.html"
    with BrokenScratch(cluster, "node3"):
        o = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(profile), "--no-history", "--timeout", "90",
                            "--report", str(page), "--quiet"], capture_output=True, text=True, timeout=180)
    shutil.rmtree(short, ignore_errors=True)
    assert o.returncode == 1, o.stderr
    browser.set_window_size(1000, 700)
    try:
        assert_offline(open_page(browser, page))
        # The whole page in one picture.
        browser.set_window_size(1000, browser.execute_script("return document.documentElement.scrollHeight") + 140)
        bar = css(browser, 'rect.bar[data-node="node3"]')[0]
        assert "fail" in bar.get_attribute("class") and bar.is_displayed()
        row = css(browser, 'tr[data-node="node3"]')[0]
        assert row.is_displayed() and row.get_attribute("data-status") == "fail"
        others = {r.get_attribute("data-node"): r.get_attribute("data-status") for r in css(browser, "tr[data-node]")}
        assert others.pop("node3") == "fail" and set(others.values()) <= {"pass", "warn"}   # a busy machine may warn
        shot = screenshot(browser, "sweep-report-devcluster.png")
    finally:
        browser.set_window_size(*WINDOW)
    if os.environ.get("CLUSTEROPS_UPDATE_DOCS") == "1":
        shutil.copyfile(shot, REPO / "docs" / "img" / "sweep-report.png")
