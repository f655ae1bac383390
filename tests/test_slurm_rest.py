"""The REST backend's pure parts (no cluster): URLs, tokens, the version choice, each
adapter's requests, and the records slurmrestd 22.05 sent (tests/fixtures/slurm/22.05/restd_*,
recorded from the dev cluster's slurmrestd). The backend against a real slurmrestd is
tests/integration/test_slurm_contract.py and tests/integration/test_slurm_restd.py."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import pytest

from clusterops.errors import InputError
from clusterops.slurm import parse
from clusterops.slurm import pyslurm_backend as sbatch_options
from clusterops.slurm.rest_backend import ADAPTERS, Unserved, pick_adapter
from clusterops.slurm.restd import (Endpoint, KeyTokens, StaticToken, check_url, error_numbers, error_text,
                                    sign_token, token_claims)
from clusterops.slurm.settings import SlurmSettings

FIX = Path(__file__).parent / "fixtures" / "slurm" / "22.05"


def load(name):
    return json.loads((FIX / name).read_text())


# ------------------------------------------------------------------------------- URLs
@pytest.mark.parametrize("url, shown", [
    ("unix:///run/slurmrestd.socket", "unix:///run/slurmrestd.socket"),
    ("http://127.0.0.1:6820", "http://127.0.0.1:6820"),
    ("https://rest.example.org", "https://rest.example.org:443"),
    ("https://alice:pw@rest.example.org:8443/api/?token=abc", "https://rest.example.org:8443/api"),
])
def test_urls_are_shown_without_secrets(url, shown):
    assert check_url(url)[2] == shown


@pytest.mark.parametrize("url", ["", "ftp://x", "unix:relative/sock", "http://", "http://h:notaport",
                                 "https://bob:pw@:1"])
def test_a_bad_url_is_one_line_without_the_password(url):
    with pytest.raises(InputError) as e:
        check_url(url)
    assert "\n" not in str(e.value) and "pw" not in str(e.value)


def test_settings_take_the_url_and_the_rest_backend_needs_one():
    s = SlurmSettings.from_environment({"CLUSTEROPS_SLURM_URL": " unix:///s ", "CLUSTEROPS_SLURM_JWT_KEY": "/k",
                                        "CLUSTEROPS_SLURM_CA_FILE": " /ca.pem "})
    assert (s.url, s.jwt_key, s.backend, s.ca_file) == ("unix:///s", "/k", "auto", "/ca.pem")
    with pytest.raises(InputError, match="CLUSTEROPS_SLURM_URL"):
        SlurmSettings.from_environment({"CLUSTEROPS_SLURM_BACKEND": "rest"})


def test_an_https_ca_file_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    """The CA bundle is read when the endpoint is made, before any request (tests/integration/
    test_slurm_restd.py checks https itself, through a TLS proxy)."""
    token = StaticToken("x.eyJzdW4iOiJ1In0.y")
    assert Endpoint("https://h:1", token)._tls.verify_mode == ssl.CERT_REQUIRED
    assert Endpoint("https://h:1", token)._tls.check_hostname
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    for path, why in ((tmp_path / "missing.pem", "No such file"), (not_pem, "no PEM certificate")):
        with pytest.raises(InputError) as e:
            Endpoint("https://h:1", token, ca_file=str(path))
        assert str(e.value).startswith(f"$CLUSTEROPS_SLURM_CA_FILE={path}: ") and why in str(e.value)
        assert "\n" not in str(e.value) and e.value.exit_code == 2
    assert Endpoint("http://h:1", token, ca_file=str(tmp_path / "missing.pem"))._tls is None


# ----------------------------------------------------------------------------- tokens
def test_signed_tokens_carry_user_and_lifespan_and_verify(tmp_path):
    import base64
    import hashlib
    import hmac

    key = b"k" * 32
    tok = sign_token(key, "alice", 1000.0, 600)
    assert token_claims(tok) == {"iat": 1000, "exp": 1600, "sun": "alice"}
    head, body, mac = tok.split(".")
    want = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
    assert base64.urlsafe_b64decode(mac + "=" * (-len(mac) % 4)) == want


def test_key_tokens_are_renewed_before_they_expire(tmp_path):
    key = tmp_path / "jwt.key"
    key.write_bytes(b"s" * 32)
    now = [1000.0]
    src = KeyTokens(str(key), "bob", lifespan_s=300, clock=lambda: now[0])
    first = src.token()
    now[0] += 150
    assert src.token() == first                      # more than a third left: kept
    now[0] += 60                                     # 210 s of 300 gone: renewed
    second = src.token()
    assert second != first and token_claims(second)["exp"] == 1210 + 300
    missing = KeyTokens(str(tmp_path / "nope"), "bob")
    with pytest.raises(InputError, match="CLUSTEROPS_SLURM_JWT_KEY"):
        missing.token()


def test_a_static_token_that_expired_is_one_line_saying_how_to_renew():
    tok = sign_token(b"x" * 32, "carol", 1000.0, 60)
    now = [1030.0]
    src = StaticToken(tok, clock=lambda: now[0])
    assert src.user == "carol" and src.token() == tok
    now[0] = 1061.0
    with pytest.raises(InputError, match="expired at .* `scontrol token") as e:
        src.token()
    assert tok not in str(e.value)
    with pytest.raises(InputError, match="CLUSTEROPS_SLURM_USER"):
        StaticToken("not-a-jwt")


# -------------------------------------------------------------------------- versions
def test_discovery_of_the_recorded_22_05_server_picks_v0_0_38():
    import re

    doc = load("restd_openapi_paths.json")
    served = sorted({m.group(1) for p in doc["paths"] for m in [re.match(r"/slurm/(v[\d.]+)/", p)] if m})
    assert served == ["v0.0.36", "v0.0.37", "v0.0.38"]
    assert pick_adapter(served, "unix:///s").version == "v0.0.38"


@pytest.mark.parametrize("served, picked", [
    (["v0.0.40", "v0.0.41", "v0.0.42"], "v0.0.42"),                 # 24.11
    (["v0.0.41", "v0.0.42", "v0.0.43", "v0.0.44"], "v0.0.42"),      # 25.11
    (["v0.0.42", "v0.0.43", "v0.0.44", "v0.0.45"], "v0.0.42"),      # 26.05
])
def test_the_newest_known_version_is_chosen(served, picked):
    assert pick_adapter(served, "http://h:1").version == picked


def test_a_server_without_a_known_version_is_one_line_naming_the_url():
    with pytest.raises(InputError) as e:
        pick_adapter(["v0.0.43", "v0.0.44"], "https://rest.example.org:443")
    msg = str(e.value)
    assert msg.startswith("slurmrestd at https://rest.example.org:443 serves v0.0.43, v0.0.44")
    assert "v0.0.38" in msg and "\n" not in msg


# -------------------------------------------------------------------------- requests
def _fields(args, text="#!/bin/bash\n#SBATCH --job-name=x\ntrue\n"):
    return sbatch_options.submit_fields(text, args, None)


def test_v0_0_38_job_description():
    a = ADAPTERS["v0.0.38"]
    d = a.job_description(_fields(["--nodes=2", "--time=1:30:00", "--signal=USR1@30",
                                   "--open-mode=append", "--requeue", "--exclusive", "--hold"]),
                          {"A": "1"}, "/w")
    assert d == {"current_working_directory": "/w", "environment": {"A": "1"}, "name": "x", "nodes": 2,
                 "tasks": 2, "time_limit": 90, "signal": "10@30", "open_mode": "append",
                 "requeue": True, "exclusive": "true", "hold": True}
    # What 22.05's v0.0.38 cannot take (no field, or it refuses every value): sbatch's.
    for args in (["--nodelist=node1"], ["--exclude=node1"], ["--signal=B:USR1@30"], ["--no-kill"]):
        with pytest.raises(Unserved):
            a.job_description(_fields(args), {}, "/w")
    with pytest.raises(Unserved):
        a.job_update({"ExcNodeList": "node3"})
    with pytest.raises(Unserved):
        a.node_change("DRAIN", "clusterops: x")
    assert a.signal_query(None, False, False) == {}
    with pytest.raises(Unserved):
        a.signal_query("USR1", True, False)


@pytest.mark.parametrize("version", ["v0.0.40", "v0.0.41", "v0.0.42"])
def test_v0_0_4x_job_description_node_update_and_signals(version):
    a = ADAPTERS[version]
    d = a.job_description(_fields(["--nodes=1", "--nodelist=node[1-2]", "--exclude=node3", "--time=5",
                                   "--signal=B:USR1@30", "--exclusive", "--open-mode=truncate", "--no-kill"]),
                          {"A": "1", "B": "x=y"}, "/w")
    assert d["environment"] == ["A=1", "B=x=y"] and d["nodes"] == "1" and d["tasks"] == 1
    assert d["required_nodes"] == ["node1", "node2"] and d["excluded_nodes"] == ["node3"]
    assert (d["kill_warning_signal"], d["kill_warning_delay"], d["kill_warning_flags"]) == ("10", 30, ["BATCH_JOB"])
    assert d["shared"] == ["none"] and d["open_mode"] == ["TRUNCATE"] and d["time_limit"] == 5
    assert d["kill_on_node_fail"] is False
    assert a.job_update({"ExcNodeList": "node[1-2]", "TimeLimit": "10"}) == \
        {"excluded_nodes": ["node1", "node2"], "time_limit": 10}
    assert a.node_change("DRAIN", "clusterops: r") == {"state": ["DRAIN"], "reason": "clusterops: r"}
    assert a.node_change("RESUME", None) == {"state": ["RESUME"]}
    assert a.signal_query("USR1", True, False) == {"signal": "SIGUSR1", "flags": "BATCH_JOB"}
    assert a.signal_query("9", False, True) == {"signal": "9", "flags": "FULL_JOB"}
    assert a.signal_query("TERM", False, False) == {"signal": "SIGTERM", "flags": "FULL_STEPS_ONLY"}
    assert a.path("node", "node1") == f"/slurm/{version}/node/node1"
    with pytest.raises(Unserved):
        a.job_update({"Features": "x"})


# --------------------------------------------------------------- recorded 22.05 replies
def test_recorded_v0_0_38_jobs_and_nodes_read_as_the_cli_reads_them():
    jobs = {j.job_id: j for j in (parse.job_from_json(x) for x in load("restd_jobs.json")["jobs"])}
    assert jobs[8].state == "FAILED" and jobs[8].exit_code == 3 and jobs[8].category == "failed"
    assert jobs[7].state == "COMPLETED" and jobs[7].time_limit_min == 5 and jobs[7].reason is None
    assert jobs[4].category == "pending" and jobs[4].reason == "JobHeldUser"
    nodes = {n.name: n for n in (parse.node_from_json(x) for x in load("restd_nodes.json")["nodes"])}
    assert nodes["node2"].drained and nodes["node2"].reason == "clusterops:sweep: host.paths failed"
    assert nodes["node1"].is_idle and nodes["node1"].gres == "gpu:4" and nodes["node1"].cpus == 2
    assert {k: parse.sinfo_state_word(n) for k, n in nodes.items()} == \
        {"node1": "idle", "node2": "drained", "node3": "idle", "node4": "idle"}
    part = load("restd_partition.json")["partitions"][0]
    assert parse.expand(part["nodes"]) == ["node1", "node2", "node3", "node4"]
    assert parse.parse_version(load("restd_ping.json")["meta"]["Slurm"]["release"]) == (22, 5, 8)


def test_recorded_errors_are_one_line_and_numbered():
    body = load("restd_job_unknown.json")
    assert error_text(body) == "Invalid job id specified: Unable to find JobId=99999"
    assert error_numbers(body) == [2017]


@pytest.mark.parametrize("state, flags, word", [
    ("allocated", {"DRAIN"}, "draining"), ("idle", {"DRAIN"}, "drained"), ("down", {"DRAIN"}, "drained"),
    ("idle", {"NOT_RESPONDING"}, "idle*"), ("down", {"NOT_RESPONDING"}, "down*"), ("mixed", set(), "mixed"),
    ("idle", {"POWERED_DOWN"}, "idle~"), ("idle", {"COMPLETING"}, "completing"),
])
def test_sinfo_state_words(state, flags, word):
    assert parse.sinfo_state_word(parse.NodeInfo("n", state, frozenset(flags))) == word


def test_scontrol_token_output():
    assert parse.parse_jwt_token("SLURM_JWT=abc.def.ghi\n") == "abc.def.ghi"
    with pytest.raises(ValueError):
        parse.parse_jwt_token("scontrol: error: ...\n")


def test_the_site_config_can_name_slurmrestd_and_the_variables_win(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("drain:\n  max_drained_fraction: 0.2\nslurm:\n  url: unix:///run/slurmrestd.socket\n"
                    "  jwt_key: /etc/slurm/jwt.key\n  ca_file: ~/site-ca.pem\n")
    s = SlurmSettings.from_environment({"CLUSTEROPS_HEALTH_SITE": str(site)})
    assert (s.backend, s.url, s.jwt_key) == ("auto", "unix:///run/slurmrestd.socket", "/etc/slurm/jwt.key")
    assert s.ca_file == str(Path("~/site-ca.pem").expanduser())
    s = SlurmSettings.from_environment({"CLUSTEROPS_HEALTH_SITE": str(site), "CLUSTEROPS_SLURM_URL": "http://h:1",
                                        "CLUSTEROPS_SLURM_BACKEND": "cli"})
    assert (s.backend, s.url) == ("cli", "http://h:1")
    site.write_text("slurm:\n  backend: restd\n")
    with pytest.raises(InputError) as e:
        SlurmSettings.from_environment({"CLUSTEROPS_HEALTH_SITE": str(site)})
    assert str(site) in str(e.value) and ":2" in str(e.value) and "backend" in str(e.value)
    assert e.value.exit_code == 2
