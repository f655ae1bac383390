"""SSH fan-out against a real OpenSSH server on 127.0.0.1 (started by the tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.sweep_sshd import SilentHost, Sshd

from clusterops.sweep import ssh as sshfan

pytestmark = pytest.mark.skipif(not Sshd.available(), reason="needs /usr/sbin/sshd (apt-get install openssh-server)")

REPO = Path(__file__).resolve().parents[2]
CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    s = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield s
    s.stop()


def opts(files, **kw):
    base = dict(ssh_config=files["ssh_config"], known_hosts=files["known_hosts"], timeout_s=20,
                connect_timeout_s=3, concurrency=8)
    base.update(kw)
    return sshfan.SSHOptions(**base)


@pytest.mark.timeout(60)
def test_runs_command_and_returns_exit_code_and_output(sshd):
    files = sshd.write_client_files(["h1", "h2", "h3"], suffix="-ok")
    res = sshfan.fan_out(["h1", "h2", "h3"], "echo out-$((6*7)); echo oops >&2; exit 3", opts(files))
    assert sorted(res) == ["h1", "h2", "h3"]
    for r in res.values():
        assert r.error is None, r.error
        assert (r.exit_code, r.stdout.strip(), r.stderr.strip()) == (3, "out-42", "oops")


@pytest.mark.timeout(60)
def test_unknown_host_key_is_refused_and_nothing_runs(sshd, tmp_path):
    files = sshd.write_client_files(["h1", "h2"], known=False, suffix="-unknown")
    marker = tmp_path / "ran"
    res = sshfan.fan_out(["h1", "h2"], f"touch {marker}", opts(files))
    for r in res.values():
        assert r.exit_code is None and "unknown host key" in r.error and "--accept-new-hosts" in r.error
    assert not marker.exists()
    assert Path(files["known_hosts"]).read_text() == ""


@pytest.mark.timeout(60)
def test_accept_new_hosts_records_the_key_then_it_is_trusted(sshd):
    files = sshd.write_client_files(["h1", "h2"], known=False, suffix="-accept")
    res = sshfan.fan_out(["h1", "h2"], "true", opts(files, accept_new_hosts=True))
    assert all(r.ok for r in res.values()), res
    text = Path(files["known_hosts"]).read_text()
    assert f"[127.0.0.1]:{sshd.port} ssh-ed25519" in text
    assert text.count("\n") == 1        # one name, recorded once even with two aliases in flight
    res = sshfan.fan_out(["h1"], "true", opts(files))
    assert res["h1"].ok


@pytest.mark.timeout(60)
def test_changed_host_key_is_refused_even_with_accept_new(sshd, tmp_path):
    files = sshd.write_client_files(["h1"], suffix="-changed")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, b64 = (tmp_path / "other.pub").read_text().split()[:2]
    Path(files["known_hosts"]).write_text(f"[127.0.0.1]:{sshd.port} {kind} {b64}\n")
    res = sshfan.fan_out(["h1"], "true", opts(files, accept_new_hosts=True))
    assert "CHANGED" in res["h1"].error


@pytest.mark.timeout(60)
def test_silent_host_times_out_and_the_others_go_on(sshd):
    silent = SilentHost()
    try:
        files = sshd.write_client_files(
            ["good1", "good2"], suffix="-silent",
            extra_config=f"Host dead\n    HostName 127.0.0.1\n    Port {silent.port}\n    User root\n")
        t0 = time.monotonic()
        res = sshfan.fan_out(["good1", "dead", "good2"], "echo alive", opts(files, connect_timeout_s=2,
                                                                           timeout_s=4))
        took = time.monotonic() - t0
    finally:
        silent.stop()
    assert res["good1"].stdout.strip() == "alive" and res["good2"].ok
    assert res["dead"].exit_code is None and "timed out" in res["dead"].error
    assert took < 15


@pytest.mark.timeout(60)
def test_wrong_key_is_an_auth_error(sshd, tmp_path):
    files = sshd.write_client_files(["h1"], suffix="-wrongkey")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    res = sshfan.fan_out(["h1"], "true", opts(files, key_filename=str(tmp_path / "k")))
    assert "authentication" in res["h1"].error


@pytest.mark.timeout(120)
def test_sweep_via_ssh_runs_the_real_health_check(sshd, tmp_path):
    """`clusterops sweep --via ssh`: three reachable nodes run the real
    `clusterops health check --json` (the venv's, by absolute path); one silent node times
    out, is reported unreachable, and the sweep finishes anyway."""
    silent = SilentHost()
    empty_known = tmp_path / "empty_known_hosts"
    empty_known.write_text("")
    try:
        files = sshd.write_client_files(
            ["node1", "node2", "node3"], suffix="-sweep",
            extra_config=f"Host node4\n    HostName 127.0.0.1\n    Port {silent.port}\n    User root\n"
                         f"Host node5\n    HostName 127.0.0.1\n    Port {sshd.port}\n    User root\n"
                         f"    IdentityFile {sshd.root}/client_key\n    UserKnownHostsFile {empty_known}\n")
        out = subprocess.run(
            [CLUSTEROPS, "sweep", "--via", "ssh", "--nodes", "node[1-5]", "--profile", "fast", "--json",
             "--ssh-config", files["ssh_config"], "--timeout", "60", "--connect-timeout", "3",
             "--db", str(tmp_path / "h.db"), "--prometheus", str(tmp_path / "p.prom")],
            capture_output=True, text=True, timeout=110)
    finally:
        silent.stop()
    assert out.returncode == 1, out.stderr          # node4 unreachable -> unhealthy fleet
    doc = json.loads(out.stdout)
    by = {n["node"]: n for n in doc["nodes"]}
    for n in ("node1", "node2", "node3"):
        assert by[n]["status"] in ("pass", "warn"), by[n]
        assert any(p["name"] for p in by[n]["probes"])           # the real check's probe results
        assert by[n]["cpu_s"] is not None and by[n]["cpu_s"] > 0
    assert by["node4"]["status"] == "unreachable" and "timed out" in by["node4"]["detail"]
    assert by["node5"]["status"] == "unreachable" and "unknown host key" in by["node5"]["detail"]
    assert by["node5"]["probes"] == [] and empty_known.read_text() == ""     # refused: nothing ran
    assert 'clusterops_sweep_node_healthy{node="node4"} 0' in (tmp_path / "p.prom").read_text()


# -- host-key pinning: a known host is pinned to the key types it is known by ---------------

@pytest.fixture(scope="module")
def sshd2(tmp_path_factory):
    """A server with two host keys, ed25519 and RSA (as most distributions ship)."""
    s = Sshd(tmp_path_factory.mktemp("sshd2"), host_key_types=("ed25519", "rsa")).start()
    yield s
    s.stop()


def _other_key(tmp_path, kind):
    path = tmp_path / f"other_{kind}"
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)]
                   + (["-b", "2048"] if kind == "rsa" else []), check=True)
    return Path(str(path) + ".pub").read_text().split()[:2]


@pytest.mark.timeout(60)
def test_known_by_ed25519_only_and_server_offers_another_ed25519_is_refused(sshd2, tmp_path):
    files = sshd2.write_client_files(["h1"], suffix="-pin-ed")
    kind, b64 = _other_key(tmp_path, "ed25519")
    kh = Path(files["known_hosts"])
    kh.write_text(f"[127.0.0.1]:{sshd2.port} {kind} {b64}\n")
    marker = tmp_path / "ran"
    res = sshfan.fan_out(["h1"], f"touch {marker}", opts(files, accept_new_hosts=True))
    # The server also has an RSA key: it must not be accepted as "new" in place of the pinned ed25519.
    assert res["h1"].exit_code is None and "CHANGED" in res["h1"].error, res["h1"]
    assert not marker.exists()
    assert kh.read_text() == f"[127.0.0.1]:{sshd2.port} {kind} {b64}\n"


@pytest.mark.timeout(60)
def test_known_by_rsa_only_connects_with_rsa(sshd2):
    files = sshd2.write_client_files(["h1"], known=False, suffix="-pin-rsa")
    kh = Path(files["known_hosts"])
    kh.write_text(sshd2.host_key_line(f"[127.0.0.1]:{sshd2.port}", "rsa"))
    before = kh.read_text()
    for accept in (False, True):
        res = sshfan.fan_out(["h1"], "echo ok", opts(files, accept_new_hosts=accept))
        assert res["h1"].ok and res["h1"].stdout.strip() == "ok", res["h1"]
        assert res["h1"].host_key_type == "ssh-rsa"
    assert kh.read_text() == before            # the server's ed25519 key was never recorded


@pytest.mark.timeout(60)
def test_known_by_rsa_only_refuses_a_different_rsa_key(sshd2, tmp_path):
    files = sshd2.write_client_files(["h1"], known=False, suffix="-pin-rsa-changed")
    kind, b64 = _other_key(tmp_path, "rsa")
    kh = Path(files["known_hosts"])
    kh.write_text(f"[127.0.0.1]:{sshd2.port} {kind} {b64}\n")
    res = sshfan.fan_out(["h1"], "true", opts(files, accept_new_hosts=True))
    assert res["h1"].exit_code is None and "CHANGED" in res["h1"].error, res["h1"]
    assert res["h1"].host_key_type == "ssh-rsa"
    assert kh.read_text() == f"[127.0.0.1]:{sshd2.port} {kind} {b64}\n"


@pytest.mark.timeout(60)
def test_known_by_rsa_but_server_has_only_ed25519_is_refused(sshd, tmp_path):
    files = sshd.write_client_files(["h1"], known=False, suffix="-pin-rsa-missing")
    kind, b64 = _other_key(tmp_path, "rsa")
    kh = Path(files["known_hosts"])
    kh.write_text(f"# a comment\n[127.0.0.1]:{sshd.port} {kind} {b64}")        # no final newline
    res = sshfan.fan_out(["h1"], "true", opts(files, accept_new_hosts=True))
    assert res["h1"].exit_code is None and "pins" in res["h1"].error and "ssh-rsa" in res["h1"].error, res["h1"]
    assert "ssh-ed25519" not in kh.read_text()


@pytest.mark.timeout(60)
def test_known_only_by_a_key_type_paramiko_cannot_load_is_refused_not_new(sshd, tmp_path):
    files = sshd.write_client_files(["h1"], known=False, suffix="-pin-sk")
    kh = Path(files["known_hosts"])
    line = f"[127.0.0.1]:{sshd.port} sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29tAAAAIA==\n"
    kh.write_text(line)
    res = sshfan.fan_out(["h1"], "true", opts(files, accept_new_hosts=True))
    assert res["h1"].exit_code is None and "cannot check" in res["h1"].error, res["h1"]
    assert kh.read_text() == line


@pytest.mark.timeout(60)
def test_unknown_host_with_accept_new_is_recorded_after_a_line_without_newline(sshd):
    files = sshd.write_client_files(["h1"], known=False, suffix="-accept-nonl")
    kh = Path(files["known_hosts"])
    kh.write_text("otherhost ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl")
    res = sshfan.fan_out(["h1"], "true", opts(files, accept_new_hosts=True))
    assert res["h1"].ok, res["h1"]
    lines = kh.read_text().splitlines()
    assert lines[0].startswith("otherhost ") and lines[1].startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")
    assert sshfan.fan_out(["h1"], "true", opts(files))["h1"].ok
