"""Stored text printed or rendered safely (issue 18).

Terminal control characters in a history row or a timeline record are shown escaped
(``\\x1b``), never sent to the terminal; every field the HTML timeline and the sweep report
render is escaped, and shortening never cuts an entity. Property tests on the helpers and
on generated timelines (every chart parses as XML).
"""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clusterops import textsafe
from clusterops.cli import main as cli_main
from clusterops.history import History
from clusterops.report import html_report
from clusterops.supervisor import timeline as tl
from support.props_harness import PROPS

# Everything a terminal acts on: C0 but tab/newline, DEL, C1, separators, bidi, BOM, surrogates.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff]")
HOSTILE = "ok\x1b[2J\x1b]0;pwned\x07\rover\x9b31m\u202eevil\x00\x7f\ud800 <b>&amp;</b>\n2nd"


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as ex:
        cli_main(list(argv))
    out, err = capsys.readouterr()
    return ex.value.code, out, err


def test_terminal_escapes_visibly():
    out = textsafe.terminal(HOSTILE)
    assert not CONTROL.search(out) and "\n" not in out and "\t" not in textsafe.terminal("a\tb")
    assert "\\x1b[2J" in out and "\\x07" in out and "\\x0d" in out and "\\x9b" in out and "\\u202e" in out
    assert "\\ud800" in out and "\\x0a2nd" in out
    assert textsafe.terminal("a\nb\tc", multiline=True) == "a\nb\tc"
    assert textsafe.terminal("plain text, ünïcode ✓") == "plain text, ünïcode ✓"


def test_history_text_output_escapes_stored_control_characters(tmp_path, capsys):
    db = str(tmp_path / "h.db")
    with History.open(db) as h:
        h.record_check({"id": "c1", "node": "node\x1b[31m1", "time": 1000.0, "status": "fail", "host": "h",
                        "results": [{"name": "host.memory", "status": "fail", "value": 1.0, "unit": "Gi\x1bB",
                                     "detail": HOSTILE.replace("\ud800", "")}]})   # no surrogate in a database
    for argv in (["health", "history", "--db", db], ["health", "history", "node\x1b[31m1", "--db", db]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        assert out.strip() and not CONTROL.search(out), out
        assert "\\x1b[2J" in out and "node\\x1b[31m1" in out
        assert all(line.count("\n") == 0 for line in out.splitlines())
    # --json stays the data itself (JSON escapes it).
    code, out, err = run_cli(capsys, "health", "history", "node\x1b[31m1", "--db", db, "--json")
    assert code == 0 and "\x1b" not in out and json.loads(out)["rows"][0]["node"] == "node\x1b[31m1"


def _hostile_timeline(tmp_path):
    w = tl.Timeline(tmp_path, job_id="7", incarnation=0)
    w.append("start", {"nodes": ["node1"]}, t=1000.0)
    w.append("launch", {"attempt": 1, "nodes": ["node1", "n\x1b]0;x\x07"], "resume_step": 0}, t=1001.0)
    w.append("step_exit", {"returncode": 1, "cause": "rank\x1b[2Jkilled", "failures": [
        {"rank": 0, "node": "node1", "reason": "A" * 70 + "&&&&&&&&&&&&<<<<\x1b"}]}, t=1002.0)
    w.append("give_up", {"code": 1, "reason": HOSTILE}, t=1003.0)
    # A record written by something else: incarnation is text.
    with open(tmp_path / tl.FILE_NAME, "a") as f:
        f.write(json.dumps({"t": 1004.0, "event": "requeue", "incarnation": "<script>x</script>\x1b[2J",
                            "reason": "r\x9b1m"}) + "\n")
    return tmp_path


def test_job_timeline_text_escapes_every_stored_field(tmp_path, capsys):
    d = _hostile_timeline(tmp_path)
    code, out, err = run_cli(capsys, "job", "timeline", str(d))
    assert code in (0, None), err
    assert not CONTROL.search(out), out
    assert "rank\\x1b[2Jkilled" in out and "\\x9b1m" in out and "[<script>x</script>\\x1b[2J]" in out
    assert len(out.splitlines()) == 7          # 5 records, summary, goodput: no newline smuggled in


def test_html_and_svg_timeline_escape_every_field_and_never_cut_an_entity(tmp_path):
    d = _hostile_timeline(tmp_path)
    recs = tl.read(d)
    svg = tl.render_svg(recs, title="job <7> & \x1b")
    root = ET.fromstring(svg)                  # well-formed XML: no control character, no cut entity
    titles = [e.text or "" for e in root.iter("{http://www.w3.org/2000/svg}title")]
    exit_title = next(t for t in titles if t.startswith("step exited"))
    assert exit_title.endswith("AAAA…")       # cut on the raw text, before any entity
    page = tl.render_html(recs, title="job <7>")
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert not CONTROL.search(page)
    assert not re.search(r"&[a-z]{0,5}(?![a-z;])", page.replace("&amp;", "").replace("&lt;", "")
                         .replace("&gt;", "").replace("&quot;", "").replace("&#x27;", ""))
    # The SVG inside the page parses too.
    ET.fromstring(page[page.index("<svg"):page.index("</svg>") + 6])


def _doc():
    return {"sweep_id": "s<1>", "started": 1000.0, "duration_s": 1.0, "exit_code": "<i>3</i>",
            "options": {"profile": "p\x1b", "via": "<v>"},
            "counts": {"pass": "<b>1</b>", "stragglers": "<s>"},
            "nodes": [{"node": "n<1>\x1b", "status": "fail\"x", "detail": HOSTILE, "duration_s": 0.5,
                       "metrics": {"matmul_tflops": 1.0}, "stragglers": ["<m>"]}],
            "medians": {}, "plan": {"guard_tripped": True, "message": "<guard>\x07", "actions": [
                {"node": "n<1>\x1b", "action": "drain", "why": "fail"}]},
            "applied": [], "errors": ["<err>\x1b"],
            "pairs": [{"nodes": ["a<", "b>"], "status": "<pp>", "busbw_gbps": "<img src=x>", "detail": "<d>",
                       "ib_write_bw": {"status": "<ibs>", "gbps": "<ibg>", "detail": "<ibd>\x1b", "gpudirect": True}}]}


def test_sweep_html_report_escapes_every_field():
    page = html_report(_doc())
    for raw in ("<i>", "<b>1", "<s>", "<v>", "<guard>", "<err>", "<img", "<d>", "<pp>", "<m>", "s<1>", "n<1>",
                "<ibs>", "<ibg>", "<ibd>"):
        assert raw not in page, raw
    assert not CONTROL.search(page)
    assert "&lt;img src=x&gt;" in page and "&lt;i&gt;3&lt;/i&gt;" in page
    assert "&lt;ibd&gt;" in page and "(GPUDirect)" in page


# ----------------------------------------------------------------------------- properties

any_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=120)


@PROPS
@given(s=any_text, multiline=st.booleans())
def test_terminal_never_lets_a_control_character_through(s, multiline):
    out = textsafe.terminal(s, multiline=multiline)
    assert not CONTROL.search(out)
    if not multiline:
        assert "\n" not in out and "\t" not in out
    out.encode("utf-8")                         # printable: no lone surrogate left


@PROPS
@given(s=any_text, limit=st.one_of(st.none(), st.integers(0, 130)))
def test_html_text_is_safe_and_shortening_never_cuts_an_entity(s, limit):
    out = textsafe.html_text(s, limit=limit)
    assert not re.search("[<>\"']", out) and not CONTROL.search(out)
    # Every & starts a whole entity, and unescaping gives back the shortened raw text
    # (controls made visible): the cut happened before the escaping.
    assert re.fullmatch(r"([^&]|&(amp|lt|gt|quot|#x27);)*", out, re.S)
    assert html.unescape(out) == textsafe.terminal(textsafe.shorten(s, limit), multiline=True)
    if limit is not None:
        assert len(textsafe.shorten(s, limit)) <= max(limit, 0)
    ET.fromstring(f"<t a=\"{out}\">{out}</t>")


field_text = st.text(max_size=40)


@PROPS
@given(recs=st.lists(st.fixed_dictionaries(
    {"t": st.floats(0, 4e9), "event": st.one_of(st.sampled_from(sorted(tl.FAULT_KINDS | tl.DECISION_KINDS
                                                                       | {"launch", "progress", "checkpoint"})),
                                                 field_text)},
    optional={"reason": field_text, "cause": field_text, "node": field_text, "incarnation": field_text,
              "nodes": st.lists(field_text, max_size=3), "step": st.integers(0, 10 ** 6)}), max_size=12))
def test_generated_timelines_render_to_well_formed_svg_and_safe_text(recs, tmp_path_factory):
    recs = sorted(recs, key=lambda r: r["t"])
    ET.fromstring(tl.render_svg(recs))
    page = tl.render_html(recs)
    ET.fromstring(page[page.index("<svg"):page.index("</svg>") + 6]) if "<svg" in page else None
    assert not CONTROL.search(page) and not CONTROL.search(tl.format_text(recs, progress=True))
