"""Property tests: generated and mutated timelines (torn lines, garbage bytes, NUL runs,
huge numbers, valid events interleaved) thrown at `clusterops job timeline` in text,
--json and --chart forms. Every damaged line is skipped and counted; the valid events
all come through; never a traceback."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from support.props_harness import PROPS, run_cli, values

from clusterops.supervisor import timeline as tl

EVENTS = sorted(tl.FAULT_KINDS | tl.DECISION_KINDS | {"launch", "progress", "checkpoint", "start", "preflight"})
FIELDS = ["nodes", "spares", "blamed", "failures", "step", "resume_step", "ckpt_step", "cause", "code", "reason",
          "returncode", "attempt", "incarnation", "job_id"]

good_t = st.one_of(st.floats(min_value=0, max_value=4e9, allow_nan=False), st.integers(0, 4_000_000_000))
bad_t = st.one_of(st.none(), st.text(max_size=5), st.booleans(), st.just([1]), st.sampled_from(
    [-1, -0.5, 1e300, 10 ** 30, 253402300800]))


@st.composite
def valid_event(draw):
    rec = {"t": draw(good_t), "event": draw(st.one_of(st.sampled_from(EVENTS), st.text(max_size=12)))}
    for k in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        rec[k] = draw(values)
    return json.dumps(rec).encode()          # NaN/Infinity in fields as Python writes them


@st.composite
def bad_t_event(draw):
    rec = {"t": draw(bad_t), "event": draw(st.sampled_from(EVENTS))}
    if draw(st.booleans()):
        del rec["t"]
    return json.dumps(rec).encode()


@st.composite
def torn(draw):
    line = draw(valid_event())
    return line[: draw(st.integers(1, max(1, len(line) - 1)))]


garbage = st.one_of(
    st.binary(min_size=1, max_size=60).map(lambda b: b.replace(b"\n", b"")),
    st.integers(1, 64).map(lambda n: b"\x00" * n),
    st.sampled_from([b"1e999", b"9" * 5000, b"[" * 3000 + b"]" * 3000, b'{"t": 1e999, "event": "x"}',
                     b'{"t": NaN, "event": "x"}', b'{"t": 1, "event": 5}', b"null", b'"str"', b"\xff\xfe",
                     b'{"t": 1, "event": "x"', b"\x1b[31m", b"\xef\xbb\xbf{}"]),
)


@st.composite
def timelines(draw):
    lines = draw(st.lists(st.one_of(valid_event().map(lambda b: ("ok", b)),
                                    bad_t_event().map(lambda b: ("bad", b)),
                                    torn().map(lambda b: ("bad", b)),
                                    garbage.map(lambda b: ("bad", b))), max_size=25))
    # A crash mid-write followed by a requeued incarnation appending: a torn line glued to
    # the next record is one damaged line.
    if lines and draw(st.booleans()):
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = ("bad", draw(torn()) + lines[i][1])
    return lines


@PROPS
@given(lines=timelines(), final_newline=st.booleans())
def test_timeline_skips_and_counts_damaged_lines(tmp_path_factory, lines, final_newline):
    d = tmp_path_factory.mktemp("job")
    data = b"\n".join(b for _, b in lines) + (b"\n" if final_newline else b"")
    (d / tl.FILE_NAME).write_bytes(data)
    n_ok = sum(1 for kind, _ in lines if kind == "ok")
    n_bad = sum(1 for kind, b in lines if kind == "bad" and b.strip())

    o = run_cli(["job", "timeline", str(d), "--json"])
    assert o.code == 0
    doc = o.json()
    assert len(doc["records"]) == n_ok
    assert doc["summary"]["skipped_lines"] == n_bad == len(doc["skipped_lines"])

    o = run_cli(["job", "timeline", str(d), "--progress", "--chart", str(d / "c.svg")])
    assert o.code == 0
    assert (f"skipped {n_bad} unreadable line(s)" in o.stderr) == (n_bad > 0)
    svg = (d / "c.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")

    o = run_cli(["job", "timeline", str(d), "--chart", str(d / "c.html")])
    assert o.code == 0 and (d / "c.html").read_text().startswith("<!doctype html>")


def test_nan_in_a_record_is_null_in_strict_json(tmp_path):
    (tmp_path / tl.FILE_NAME).write_text('{"t": 1, "event": "progress", "step": 3, "loss": NaN, "x": Infinity}\n'
                                         '{"t": 2, "event": "done", "code": 0}\n')
    o = run_cli(["job", "timeline", str(tmp_path), "--json"])
    rec = o.json()["records"][0]
    assert rec["loss"] is None and rec["x"] is None and rec["step"] == 3


def test_chart_onto_a_fifo_or_missing_directory_is_refused(tmp_path):
    import os

    (tmp_path / tl.FILE_NAME).write_text('{"t": 1, "event": "start"}\n')
    fifo = tmp_path / "c.svg"
    os.mkfifo(fifo)
    o = run_cli(["job", "timeline", str(tmp_path), "--chart", str(fifo)], max_wall_s=5)
    assert o.code == 2 and "FIFO" in o.stderr
    o = run_cli(["job", "timeline", str(tmp_path), "--chart", str(tmp_path / "nope" / "c.svg")])
    assert o.code == 2 and "does not exist" in o.stderr


def test_timeline_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    os.mkfifo(tmp_path / tl.FILE_NAME)
    o = run_cli(["job", "timeline", str(tmp_path)], max_wall_s=5)
    assert o.code == 2 and "not a regular file" in o.stderr
