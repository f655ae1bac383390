"""The health-check spool never blocks on a malformed file, and no DSN secret leaves it (issue 18).

A spooled file that can never be stored (garbage bytes, JSON nested too deep, not a report,
a report whose fields have the wrong types, a FIFO, text the database cannot hold) is set
aside as ``.<name>.bad`` with its reason in ``.<name>.bad.why``, and the good reports
behind it are stored in the same flush. Property tests throw arbitrary bytes and arbitrary
JSON at it. Secrets in a database target (userinfo, ``?password=``, ``passfile``, a
``key=value`` string) are redacted in every message, JSON output and spool record.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clusterops import spool
from clusterops.cli import main as cli_main
from clusterops.errors import ClusteropsError
from clusterops.history import History, parse_target, redact, redact_text
from support.props_harness import PROPS


def report(node: str = "n1", t: float = 1000.0, cid: str = "") -> dict:
    return {"id": cid or uuid.uuid4().hex, "node": node, "time": t, "status": "pass", "exit_code": 0,
            "profile": "fast", "host": "h", "duration_s": 0.1,
            "results": [{"name": "host.memory", "status": "pass", "value": 12.5, "unit": "GiB", "detail": ""}]}


def _put(spool_dir: Path, name: str, data: bytes) -> Path:
    spool_dir.mkdir(parents=True, exist_ok=True)
    p = spool_dir / name
    p.write_bytes(data)
    return p


def _settings(tmp_path: Path) -> spool.RecordSettings:
    return spool.RecordSettings(str(tmp_path / "h.db"), tmp_path / "spool", timeout_s=2)


def _stored_ids(tmp_path: Path) -> set:
    with History.open(str(tmp_path / "h.db"), create=False) as h:
        return {c["id"] for c in h.checks()}


DEEP = b"[" * 100_000 + b"]" * 100_000

MALFORMED = [
    ("garbage", b"\x00\xff\xfe not json at all"),
    ("not-utf8", b'{"id": "\xff\xfe"}'),
    ("deep", DEEP),
    ("list", b"[1, 2, 3]"),
    ("no-id", b'{"node": "n1"}'),
    ("int-id", b'{"id": 5, "node": "n1"}'),
    ("results-not-objects", json.dumps({"id": "r1", "node": "n1", "results": [1, "x"]}).encode()),
    ("node-a-list", json.dumps({"id": "r2", "node": ["n1"]}).encode()),
    ("lone-surrogate", b'{"id": "r3", "node": "n\\ud800", "results": []}'),
    ("huge-exit-code", json.dumps({"id": "r4", "node": "n1", "exit_code": 1 << 70}).encode()),
    ("empty", b""),
]


def test_malformed_spool_files_are_set_aside_with_their_reason_and_never_block(tmp_path):
    s = _settings(tmp_path)
    names = []
    for i, (label, data) in enumerate(MALFORMED):
        names.append(_put(s.spool_dir, f"{i:020d}-{label}.json", data).name)
    os.mkfifo(s.spool_dir / f"{len(MALFORMED):020d}-fifo.json")      # would block a plain read forever
    names.append(f"{len(MALFORMED):020d}-fifo.json")
    good = report(cid="good-one")
    t0 = time.monotonic()
    res = spool.record(good, s)
    assert time.monotonic() - t0 < 20
    assert res["recorded"] == 1 and res["pending"] == 0, res
    assert "set aside" in res["error"]
    assert "good-one" in _stored_ids(tmp_path)
    left = sorted(os.listdir(s.spool_dir))
    assert not [n for n in left if n.endswith(".json") and not n.startswith(".")]
    for n in names:
        bad = s.spool_dir / f".{n}.bad"
        assert bad.exists(), (n, left)
        why = (s.spool_dir / f".{n}.bad.why").read_text().strip()
        assert why and "\n" not in why, n
    assert "nested too deep" in (s.spool_dir / f".{names[2]}.bad.why").read_text()
    assert "not UTF-8" in (s.spool_dir / f".{names[1]}.bad.why").read_text()
    assert "not a regular file" in (s.spool_dir / f".{names[-1]}.bad.why").read_text()
    # The next flush has nothing left to trip on.
    res = spool.record(report(cid="next"), s)
    assert res["recorded"] == 1 and res["error"] is None and res.get("damaged") is None


def test_set_aside_files_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(spool, "MAX_BAD_FILES", 3)
    s = _settings(tmp_path)
    for i in range(6):
        _put(s.spool_dir, f"{i:020d}-x.json", b"garbage")
    spool.record(report(), s)
    bad = sorted(n for n in os.listdir(s.spool_dir) if n.endswith(".bad"))
    assert bad == [f".{i:020d}-x.json.bad" for i in (3, 4, 5)]
    assert len([n for n in os.listdir(s.spool_dir) if n.endswith(".why")]) == 3


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(
        st.sampled_from(["id", "node", "time", "status", "results", "exit_code", "profile", "host", "name",
                         "value", "unit", "detail", "duration_s", "x"]), kids, max_size=8),
    max_leaves=30)


def _check_spool_after(tmp_path: Path, s: spool.RecordSettings, name: str, res: dict, good_id: str) -> None:
    assert good_id in _stored_ids(tmp_path)
    assert res["pending"] == 0
    left = os.listdir(s.spool_dir)
    assert not [n for n in left if n.endswith(".json") and not n.startswith(".")]
    if f".{name}.bad" in left:
        why = (s.spool_dir / f".{name}.bad.why").read_text()
        assert why.strip() and why.count("\n") == 1


@PROPS
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes_in_a_spool_file_never_block_nor_crash_the_spool(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("spool")
    s = _settings(tmp)
    _put(s.spool_dir, "00000000000000000001-x.json", data)
    good = report(cid="g-" + uuid.uuid4().hex)
    res = spool.record(good, s)
    _check_spool_after(tmp, s, "00000000000000000001-x.json", res, good["id"])


@PROPS
@given(doc=json_values)
def test_arbitrary_json_in_a_spool_file_never_blocks_nor_crashes_the_spool(tmp_path_factory, doc):
    tmp = tmp_path_factory.mktemp("spool")
    s = _settings(tmp)
    name = "00000000000000000001-x.json"
    _put(s.spool_dir, name, json.dumps(doc).encode())
    good = report(cid="g-" + uuid.uuid4().hex)
    res = spool.record(good, s)
    _check_spool_after(tmp, s, name, res, good["id"])
    left = os.listdir(s.spool_dir)
    # Either stored (it was a report) or set aside with its reason: never both, never lost.
    stored = isinstance(doc, dict) and isinstance(doc.get("id"), str) and doc["id"] in _stored_ids(tmp)
    assert stored != (f".{name}.bad" in left) or (isinstance(doc, dict) and doc.get("id") == good["id"])


# ----------------------------------------------------------------------------- secrets in a DSN


SECRET = "s3cr3t-Pw"
DSNS = [
    f"postgresql://alice:{SECRET}@db1:5432/fleet",
    f"postgresql://alice@db1/fleet?password={SECRET}",
    f"postgresql://alice@db1/fleet?sslmode=require&password={SECRET}&connect_timeout=2",
    f"postgresql://alice@db1/fleet?pass%77ord={SECRET}",
    f"postgresql://alice@db1/fleet?passfile=/home/alice/{SECRET}",
    f"postgresql://alice@db1/fleet?sslpassword={SECRET}",
    f"postgres://alice:{SECRET}@[::1]:5432/fleet?password={SECRET}",
    f"host=db1 user=alice password={SECRET} dbname=fleet",
    f"host=db1 password='{SECRET} x' dbname=fleet",
]


@pytest.mark.parametrize("dsn", DSNS)
def test_redact_hides_every_secret_of_a_dsn(dsn):
    out = redact(dsn)
    assert SECRET not in out and "***" in out
    # What a driver would echo: the whole value.
    told = f"/home/alice/{SECRET}" if "passfile" in dsn else f"{SECRET} x" if " x'" in dsn else SECRET
    assert SECRET not in redact_text(f"connection to {dsn} failed: bad {told}", dsn)


def test_redact_keeps_what_is_not_secret():
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact("postgresql://u@h/db?sslmode=require") == "postgresql://u@h/db?sslmode=require"
    assert redact(f"postgresql://u@h/db?password={SECRET}&sslmode=require") == \
        "postgresql://u@h/db?password=***&sslmode=require"


@pytest.mark.parametrize("dsn", [d for d in DSNS if d.startswith("postgres")])
def test_no_secret_in_messages_json_or_spool_records(dsn, tmp_path, capsys):
    target = dsn.replace("db1", "127.0.0.1:1").replace("[::1]:5432", "127.0.0.1:1")
    assert SECRET not in parse_target(target).display
    with pytest.raises(ClusteropsError) as e:
        History.open(target, timeout_s=1)
    assert SECRET not in e.value.message
    # health history: the one-line error and the JSON output.
    with pytest.raises(SystemExit) as ex:
        cli_main(["health", "history", "--db", target, "--json"])
    out, err = capsys.readouterr()
    assert ex.value.code != 0 and SECRET not in out + err
    # The spool: its record of what happened, and the files it writes.
    s = spool.RecordSettings(target, tmp_path / "spool", timeout_s=1)
    res = spool.record(report(), s)
    assert res["error"] and res["pending"] == 1
    assert SECRET not in json.dumps(res)
    for p in (tmp_path / "spool").iterdir():
        assert SECRET.encode() not in p.read_bytes()


secret_text = st.text(alphabet=st.characters(min_codepoint=0x30, max_codepoint=0x7a,
                                             blacklist_characters="@:/?#&='\\[]%"), min_size=3, max_size=20)


@PROPS
@given(pw=secret_text, form=st.sampled_from(["userinfo", "query", "query2", "passfile", "kv", "kvq"]))
def test_redaction_property(pw, form):
    pw = "Zq" + pw          # never a substring of the rest of the DSN
    dsn = {"userinfo": f"postgresql://u:{pw}@h:5432/db",
           "query": f"postgresql://u@h/db?password={pw}",
           "query2": f"postgresql://u@h/db?a=1&PASSWORD={pw}&b=2",
           "passfile": f"postgresql://u@h/db?passfile={pw}",
           "kv": f"host=h password={pw} dbname=db",
           "kvq": f"host=h password = '{pw} ' dbname=db"}[form]
    assert pw not in redact(dsn)
    assert pw not in redact_text(f"error: {dsn}: {pw}", dsn)
    assert pw not in redact_text(f"error: {dsn}")
