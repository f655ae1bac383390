"""Property tests: whatever bytes reach the heartbeat receiver (garbage, deep nesting,
mutated real datagrams, JSON of any shape, another attempt's token) the decoder raises
nothing but BadDatagram, the receiver thread keeps running and still takes the next good
datagram; and whatever a supervisor state file holds, loading it gives back exactly what
was saved or a one-line InputError naming the file, never another exception."""

from __future__ import annotations

import json
import socket

from hypothesis import given
from hypothesis import strategies as st

from support.props_harness import PROPS, values
from test_heartbeat_channel import wait_for

from clusterops import heartbeat as hbc
from clusterops import supervisor as sv
from clusterops.errors import InputError
from clusterops.supervisor import channel as ch
from clusterops.supervisor import run as svrun

TOKEN = "0123456789abcdef" * 2
ints = st.one_of(st.integers(-2, 10 ** 6), st.sampled_from([True, 10 ** 40, -10 ** 40]))


@st.composite
def datagram_like(draw):
    """A datagram-shaped object with each field possibly wrong."""
    body = {"v": draw(st.sampled_from([1, 1, 1, 2, "1", None])),
            "tok": draw(st.sampled_from([TOKEN, TOKEN, "other", "", 5])),
            "node": draw(st.one_of(st.sampled_from(["n1", "", "a/b"]), st.text(max_size=8))),
            "seq": draw(ints),
            "ranks": draw(st.one_of(st.lists(st.lists(ints, min_size=3, max_size=5), max_size=6), values))}
    if draw(st.booleans()):
        body["busy"] = draw(st.one_of(st.lists(ints, max_size=6), values))
    for key in draw(st.lists(st.sampled_from(list(body)), max_size=2, unique=True)):
        del body[key]
    return json.dumps(body, separators=(",", ":")).encode()


@st.composite
def nested(draw):
    depth = draw(st.one_of(st.integers(1, 3000), st.just(60_000)))
    open_, close = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b'{"v":1,"tok":"' + TOKEN.encode()
                                                                            + b'","ranks":[', b"]}")]))
    return open_ * depth + draw(st.sampled_from([b"1", b"", b'"x"'])) + close * draw(st.integers(0, depth))


@st.composite
def mutated(draw):
    data = bytearray(hbc.encode(hbc.Datagram(TOKEN, "n1", 3, tuple(
        hbc.RankBeat(r, 10, 5, 100, 40) for r in range(draw(st.integers(0, 8)))))))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["flip", "cut", "dup", "insert"]))
        if op == "flip" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "dup":
            data[i:i] = data[i:i + draw(st.integers(1, 40))] * draw(st.integers(1, 200))
        else:
            data[i:i] = draw(st.sampled_from([b"[", b"{", b'"', b"\\", b"\x00", b"\xff", b"1e999", b"-0"]))
    return bytes(data)


at_the_limit = st.builds(lambda n, b: b * (hbc.MAX_DATAGRAM + n), st.integers(-2, 2), st.sampled_from([b"[", b" ", b"\xff"]))
anything = st.one_of(st.binary(max_size=2000), datagram_like(), nested(), mutated(), at_the_limit)


@PROPS
@given(data=anything, with_token=st.booleans())
def test_decode_raises_nothing_but_bad_datagram(data, with_token):
    try:
        d = hbc.decode(data, TOKEN if with_token else None)
    except hbc.BadDatagram:
        return
    assert isinstance(d, hbc.Datagram) and d.node and all(b.rank >= 0 and b.age_ms >= 0 for b in d.ranks)
    assert not with_token or d.token == TOKEN


@PROPS
@given(batch=st.lists(anything, min_size=1, max_size=5))
def test_arbitrary_datagrams_never_end_the_receiver(batch):
    r = ch.Receiver(TOKEN, bind_host="127.0.0.1").start()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sent = 0
        for data in batch:
            try:
                s.sendto(data, ("127.0.0.1", r.port))
                sent += 1
            except OSError:            # larger than a datagram may be (EMSGSIZE): never arrives
                pass
        s.sendto(hbc.encode(hbc.Datagram(TOKEN, "marker", 1, (hbc.RankBeat(123456, 9, 0, -1),))),
                 ("127.0.0.1", r.port))
        wait_for(lambda: "marker" in r.nodes or not r._thread.is_alive())
        assert r._thread.is_alive()
        assert r.received + r.dropped == sent + 1
        assert r.snapshot()[123456][0] == 9
    finally:
        s.close()
        r.close()


# ------------------------------------------------------------------------------ state files
count = st.integers(0, 10 ** 6)
memories = st.builds(sv.Memory, bad_nodes=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=20),
                                                          max_size=3),
                     attempts=count, restarts=count, no_progress=count, last_ckpt_step=st.one_of(st.none(), count))


@PROPS
@given(mem=memories)
def test_a_saved_state_loads_back_exactly(mem, tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    svrun.save_memory(d, mem)
    assert svrun.load_memory(d) == mem


@st.composite
def state_like(draw):
    body = draw(memories).to_dict()
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(body) + ["extra"]))
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(values)
    return json.dumps(body)


@PROPS
@given(text=st.one_of(state_like(), st.text(max_size=200), st.builds(json.dumps, values),
                      st.sampled_from(["[]", "{}", "null", "[" * 50_000, "1e999", '{"restarts": NaN}'])))
def test_any_state_file_loads_or_is_one_line_naming_it(text, tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    (d / svrun.STATE_FILE).write_text(text)
    try:
        mem = svrun.load_memory(d)
    except InputError as e:
        assert "\n" not in e.message and e.message.startswith(str(d / svrun.STATE_FILE)), e.message
        return
    # Loaded: exactly the numbers that were there (nothing reset, nothing coerced).
    body = json.loads(text)
    assert (mem.attempts, mem.restarts, mem.no_progress) == (body["attempts"], body["restarts"], body["no_progress"])
    assert mem.last_ckpt_step == body.get("last_ckpt_step") and mem.bad_nodes == body.get("bad_nodes", {})
    assert all(type(v) is int and v >= 0 for v in (mem.attempts, mem.restarts, mem.no_progress))
