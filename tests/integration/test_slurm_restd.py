"""The REST backend from where it matters: a host without the Slurm commands on PATH.

The dev cluster runs a real slurmrestd (JWT, ``restd=True``; tests/conftest.py starts it
wherever slurmrestd is installed). Here clusterops runs with ``CLUSTEROPS_SLURM_URL`` set and
a PATH that holds every program of this machine except Slurm's client commands: its job
queries, node reads and a sweep go through slurmrestd or fail with a one-line error that
names what is missing. The contract itself (every method, against the CLI and pyslurm
backends) is tests/integration/test_slurm_contract.py. The ``https`` tests put a
TLS-terminating proxy (tests/support/tls_proxy.py) in front of slurmrestd's TCP port.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from support.tls_proxy import TlsForwarder, make_pki
from support.wait import wait_for

from clusterops.errors import InputError
from clusterops.slurm.factory import connect
from clusterops.slurm.settings import SlurmSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")
# Slurm's client programs (slurm-client and slurm-wlm-basic-plugins' bin/): none may be found.
SLURM_COMMANDS = {"sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel", "sacct", "sacctmgr", "salloc",
                  "sattach", "sbcast", "scrontab", "sdiag", "sprio", "sreport", "sshare", "sstat", "strigger",
                  "sview", "scrun", "sh5util", "sjobexitmod", "sjstat", "smail", "seff", "slurmrestd"}


@pytest.fixture
def restd(cluster):
    urls = cluster.restd_urls()
    if not urls:
        why = "slurmrestd is not installed here (apt-get install slurmrestd)"
        if os.environ.get("CLUSTEROPS_TEST_REQUIRE_RESTD"):
            pytest.fail(f"the REST backend must run on this tier: {why}")
        pytest.skip(why)
    return urls


def no_slurm_env(tmp_path, cluster, url):
    """The environment of a host without Slurm's commands: PATH is a folder of links to every
    program on this PATH but Slurm's, then the venv's bin; the REST settings are set."""
    farm = tmp_path / "bin-without-slurm"
    farm.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not d or not os.path.isdir(d) or d == str(Path(sys.executable).parent):
            continue
        for entry in os.scandir(d):
            if entry.name in SLURM_COMMANDS or (farm / entry.name).exists():
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                (farm / entry.name).symlink_to(entry.path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTEROPS_SLURM_", "SLURM_"))}
    env.update({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{farm}", "CLUSTEROPS_SLURM_URL": url,
                "CLUSTEROPS_SLURM_JWT_KEY": str(cluster.jwt_key), "SLURM_CONF": cluster.env()["SLURM_CONF"]})
    for name in SLURM_COMMANDS:
        assert shutil.which(name, path=env["PATH"]) is None, name
    return env


def cli(env, *args, timeout=120):
    return subprocess.run([CLUSTEROPS, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_job_query_and_node_reads_without_slurm_commands(cluster, restd, tmp_path):
    plain = connect(replace(SlurmSettings.from_environment(), backend="cli"))
    jid = plain.submit(text="#!/bin/bash\nexit 5\n", args=["--job-name=restq", f"--output={tmp_path}/q.out"])
    wait_for(lambda: plain.job(jid).category == "failed", what="the job fails")
    env = no_slurm_env(tmp_path, cluster, restd["unix"])

    out = cli(env, "slurm", "job", str(jid), "--json")
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    assert job["job_id"] == jid and job["state"] == "FAILED" and job["exit_code"] == 5 and job["name"] == "restq"

    out = cli(env, "slurm", "nodes", "--json")
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)
    assert [n["name"] for n in nodes] == ["node1", "node2", "node3", "node4"]
    assert all(n["state"] == "idle" and "gpu" in n["gres"] for n in nodes)

    out = cli(env, "slurm", "version", "--json")
    assert out.returncode == 0, out.stderr
    assert tuple(json.loads(out.stdout)["version"]) == plain.controller_version()

    # And the same host submits and queries a job of its own (v0.0.38 takes this one too).
    out = cli(env, "slurm", "submit", "--json", str(_script(tmp_path, "echo from-rest $MARKER")), "--",
              f"--output={tmp_path}/own.out", "--job-name=own")
    assert out.returncode == 0, out.stderr
    own = json.loads(out.stdout)["job_id"]
    wait_for(lambda: plain.job(own).category == "done", what="the REST-submitted job ends")
    assert "from-rest" in (tmp_path / "own.out").read_text()


def _script(tmp_path, body):
    p = tmp_path / "own.sh"
    p.write_text("#!/bin/bash\n" + body + "\n")
    return p


PROFILE = """\
description: fast + the node's scratch dir (REST sweep test)
extends: fast
probes:
  host.paths:
    paths:
      - {path: "${CLUSTEROPS_NODE_SCRATCH}", min_free_gb: 0.001, writable: true}
"""


def test_sweep_with_drains_without_slurm_commands(cluster, restd, tmp_path):
    """A sweep that drains node3 (its scratch folder gone), from a host without Slurm's
    commands. Slurm 24.11+ (v0.0.40+) serve all of it; 22.05's v0.0.38 has no node update
    and no --nodelist on a submitted job, so there the sweep cannot run without sbatch: it
    must say so, per node, in one line, and change nothing."""
    env = no_slurm_env(tmp_path, cluster, restd["unix"])
    client = connect(replace(SlurmSettings.from_environment(), backend="rest", url=restd["unix"],
                             jwt_key=str(cluster.jwt_key)))
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE)
    scratch = cluster.scratch_dir("node3")
    shutil.move(str(scratch), str(scratch) + ".away")
    try:
        out = cli(env, "sweep", "--profile", str(profile), "--db", str(tmp_path / "s.db"), "--timeout", "90",
                  "--drain", "--json", timeout=200)
    finally:
        shutil.move(str(scratch) + ".away", str(scratch))
    node3 = client.node("node3")
    if client.adapter.node_update:
        assert out.returncode == 1, out.stderr
        by = {n["node"]: n for n in json.loads(out.stdout)["nodes"]}
        assert by["node3"]["status"] == "fail" and all(by[n]["status"] in ("pass", "warn") for n in
                                                       ("node1", "node2", "node4")), by
        assert node3.drained and node3.reason.startswith("clusterops:sweep: host.path")
    else:
        assert client.adapter.version == "v0.0.38"
        by = {n["node"]: n for n in json.loads(out.stdout)["nodes"]}
        for name, r in by.items():
            assert r["status"] == "error", (name, r)
            assert "v0.0.38" in r["detail"] and "sbatch not found" in r["detail"], r["detail"]
        assert not node3.drained and node3.is_idle
        # The drain itself, asked for directly: one line, exit 1, nothing drained.
        d = cli(env, "slurm", "drain", "node3", "--reason", "rest test")
        assert d.returncode == 1 and len(d.stderr.strip().splitlines()) == 1, d.stderr
        assert "v0.0.38" in d.stderr and "scontrol not found" in d.stderr
        assert not client.node("node3").drained


def test_a_server_that_cannot_serve_us_is_one_line_exit_2_naming_the_url(cluster, restd, tmp_path):
    env = no_slurm_env(tmp_path, cluster, restd["http"])
    # Over TCP, with a token from scontrol token (the CLI client's), for real.
    via_http = connect(replace(SlurmSettings.from_environment(), backend="rest", url=restd["http"]))
    assert via_http.backend == "rest" and via_http.nodes()[0].name == "node1"
    token = "eyJhbGciOiJIUzI1NiJ9.eyJzdW4iOiJyb290IiwiZXhwIjo0MTAyNDQ0ODAwfQ.c2VjcmV0LXNpZ25hdHVyZQ"
    bad = {**{k: v for k, v in env.items() if k != "CLUSTEROPS_SLURM_JWT_KEY"}, "SLURM_JWT": token,
           "CLUSTEROPS_SLURM_READ_ATTEMPTS": "1"}
    out = cli(bad, "slurm", "nodes")
    assert out.returncode == 2, (out.returncode, out.stderr)
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1 and restd["http"] in line and token not in line and "c2VjcmV0" not in line
    # Nothing listens there: the same, after the bounded retries.
    port = int(restd["http"].rsplit(":", 1)[1])
    gone = {**env, "CLUSTEROPS_SLURM_URL": f"http://user:hunter2@127.0.0.1:{port + 7}/?x=secret",
            "CLUSTEROPS_SLURM_READ_ATTEMPTS": "1"}
    out = cli(gone, "slurm", "version")
    line = out.stderr.strip()
    assert out.returncode == 2 and len(line.splitlines()) == 1, out.stderr
    assert f"http://127.0.0.1:{port + 7}" in line and "hunter2" not in line and "secret" not in line
    with pytest.raises(InputError, match="unix:///nonexistent/sock"):
        connect(SlurmSettings(backend="rest", url="unix:///nonexistent/sock", read_attempts=1,
                              jwt_key=str(cluster.jwt_key)))


def test_every_known_version_the_server_serves_answers_alike(cluster, restd, tmp_path):
    """Not only the newest: each plugin version this Slurm serves and clusterops knows (22.05:
    v0.0.38; 24.11: v0.0.40-42; 25.11: v0.0.41-42) reads, submits, holds, signals and, where
    it can, drains through slurmrestd itself."""
    from clusterops.slurm.rest_backend import connect_rest, served_versions

    plain = connect(replace(SlurmSettings.from_environment(), backend="cli"))
    versions = served_versions(plain, restd["unix"], jwt_key=str(cluster.jwt_key))
    assert versions, "the server serves no version clusterops knows"
    # The releases' tables (Slurm's OpenAPI plugin versions by release), where we run them.
    expected = {(22, 5): ["v0.0.38"], (24, 11): ["v0.0.40", "v0.0.41", "v0.0.42"], (25, 11): ["v0.0.41", "v0.0.42"]}
    release = tuple(plain.controller_version()[:2])
    if release in expected:
        assert versions == expected[release], (release, versions)
    for v in versions:
        c = connect_rest(plain, restd["unix"], jwt_key=str(cluster.jwt_key), version=v)
        assert c.adapter.version == v and c.version() == plain.controller_version()
        assert [n.name for n in c.nodes()] == ["node1", "node2", "node3", "node4"]
        assert c.partition_nodes("debug") == ["node1", "node2", "node3", "node4"]
        out = tmp_path / f"{v}.out"
        jid = c.submit(text='#!/bin/bash\ntrap "echo got-term; exit 0" TERM\necho up\nsleep 300 & wait $!\n',
                       args=[f"--output={out}", "--time=5", f"--job-name=v{v}", "--hold"])
        assert c.job(jid).reason in ("JobHeldUser", "JobHeldAdmin")
        c.update_job(jid, TimeLimit="7")
        c.release(jid)
        wait_for(lambda: out.exists() and "up" in out.read_text(), what=f"{v}: the job runs")
        assert c.job(jid).time_limit_min == 7 and c.job(jid).name == f"v{v}"
        if c.adapter.signal_flags:
            c.signal(jid, "TERM", batch=True)
            wait_for(lambda: "got-term" in out.read_text(), what=f"{v}: TERM reaches the batch shell")
        else:
            c.cancel(jid)
        want = "done" if c.adapter.signal_flags else "CANCELLED"
        wait_for(lambda: want in (plain.job(jid).category, plain.job(jid).state), what=f"{v}: the job ends")
        if c.adapter.node_update:
            c.drain("node2", f"clusterops: test: {v}")
            n = plain.node("node2")
            assert n.drained and n.reason == f"clusterops: test: {v}"
            c.resume("node2")
            wait_for(lambda: plain.node("node2").is_idle, what=f"{v}: node2 resumed")


@pytest.mark.timeout(360)
def test_a_supervised_job_queries_slurm_through_slurmrestd(cluster, restd, tmp_path):
    """A supervised run submitted with the REST settings in its environment: its supervisor's
    Slurm client is the REST one, and after a rank is killed it heals as it does on the CLI
    (the same weights as an uninterrupted run, bitwise). The evidence that its queries went
    through slurmrestd is slurmrestd's own request log: the test itself asks only the CLI
    client while the job runs. (Inside the job Slurm's commands stay on PATH: the supervisor
    starts its training step with srun.)"""
    import signal

    from support import faultkit as fk
    from support.user_scripts import USER_SCRIPT

    steps, every = 40, 10
    script = tmp_path / "user_ddp.py"
    script.write_text(USER_SCRIPT)
    ref = tmp_path / "ref"
    fk.run_local(2, ["--steps", str(steps), "--ckpt-every", "0", "--out", str(ref / "final.pt")],
                 workdir=ref, script=script)
    plain = connect(replace(SlurmSettings.from_environment(), backend="cli"))
    env = {**os.environ, "CLUSTEROPS_SLURM_URL": restd["unix"], "CLUSTEROPS_SLURM_JWT_KEY": str(cluster.jwt_key)}
    job = fk.TrainJob(root=tmp_path / "rest", name="rest", nodes=2, steps=steps, ckpt_every=every,
                      step_sleep=0.15, script=script)
    job.submit(env=env)
    job.wait_step(15)
    log = cluster.state / "log" / "slurmrestd.out"
    offset = log.stat().st_size
    assert job.signal_rank(1, signal.SIGKILL)
    info, story = fk.assert_healed(job, plain, ref / "final.pt", timeout_s=240)
    exits = fk.events(job, "step_exit")
    assert exits[0]["cause"] == "rank_killed" and exits[0]["blamed"] == ["node2"], story
    with open(log, "rb") as f:
        f.seek(offset)
        served = [line for line in f.read().decode(errors="replace").splitlines()
                  if " GET /slurm/v0.0." in line or " POST /slurm/v0.0." in line]
    assert served, "slurmrestd served no request while the supervised job ran"


# ---------------------------------------------------------------------------------- https
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA with a certificate for IP:127.0.0.1 and one for another name."""
    try:
        return make_pki(tmp_path_factory.mktemp("pki"))
    except FileNotFoundError:
        why = "the openssl command is not installed here (apt-get install openssl)"
        if os.environ.get("CLUSTEROPS_TEST_REQUIRE_RESTD"):
            pytest.fail(f"the https tests must run on this tier: {why}")
        pytest.skip(why)


def tcp_port(restd) -> int:
    return int(restd["http"].rsplit(":", 1)[1])


def without_system_ca_overrides(env):
    """No SSL_CERT_FILE or SSL_CERT_DIR: OpenSSL's own defaults (the system's bundle)."""
    return {k: v for k, v in env.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}


def test_https_through_a_tls_proxy_reads_version_nodes_and_a_running_job(cluster, restd, pki, tmp_path,
                                                                           monkeypatch):
    """slurmrestd behind a TLS-terminating proxy whose certificate a throwaway CA signed. The
    CA trusted through SSL_CERT_FILE (OpenSSL's default verify paths, in this process), then
    through $CLUSTEROPS_SLURM_CA_FILE alone (clusterops on a host without Slurm's commands):
    the version, the nodes and a job the CLI client submitted are read through TLS."""
    plain = connect(replace(SlurmSettings.from_environment(), backend="cli"))
    jid = plain.submit(text="#!/bin/bash\nsleep 300\n", args=["--job-name=tlsq", "--time=5",
                                                              f"--output={tmp_path}/tls.out"])
    wait_for(lambda: plain.job(jid).state == "RUNNING", what="the job runs")
    with TlsForwarder(pki.server, pki.server_key, tcp_port(restd)) as proxy:
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        client = connect(replace(SlurmSettings.from_environment(), backend="rest", url=proxy.url,
                                 jwt_key=str(cluster.jwt_key)))
        assert client.backend == "rest" and client.url == proxy.url and client.endpoint.ca_file is None
        assert client.version() == plain.controller_version()
        assert [n.name for n in client.nodes()] == ["node1", "node2", "node3", "node4"]
        job, seen = client.job(jid), plain.job(jid)
        assert (job.job_id, job.name, job.state, job.node_names) == (jid, "tlsq", "RUNNING", seen.node_names)
        assert proxy.forwarded >= 1 and proxy.refused == []
        client.endpoint.close()
        monkeypatch.undo()

        env = without_system_ca_overrides(no_slurm_env(tmp_path, cluster, proxy.url))
        env["CLUSTEROPS_SLURM_CA_FILE"] = str(pki.ca)
        before = proxy.forwarded
        out = cli(env, "slurm", "job", str(jid), "--json")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert (got["job_id"], got["name"], got["state"]) == (jid, "tlsq", "RUNNING")
        assert proxy.forwarded > before
    assert proxy.errors == [] and proxy.refused == []
    plain.cancel(jid)


def test_https_refuses_an_untrusted_certificate_and_another_name_in_one_line(cluster, restd, pki, tmp_path):
    """A certificate whose CA is not trusted here, and one that a trusted CA signed for another
    name: each is refused at the handshake, at once (the default 4 read attempts: one
    handshake), exit 2, one line naming the URL and no token. Nothing reaches slurmrestd."""
    port = tcp_port(restd)
    with TlsForwarder(pki.server, pki.server_key, port) as untrusted, \
            TlsForwarder(pki.other, pki.other_key, port) as misnamed:
        env = without_system_ca_overrides(no_slurm_env(tmp_path, cluster, untrusted.url))
        out = cli(env, "slurm", "nodes")
        line = out.stderr.strip()
        assert out.returncode == 2 and len(line.splitlines()) == 1, (out.returncode, out.stderr)
        assert f"slurmrestd at {untrusted.url}: GET /openapi/v3: the server's TLS certificate was refused " \
               f"(unable to get local issuer certificate: name the CA that signed it with " \
               f"$CLUSTEROPS_SLURM_CA_FILE" in line, line
        assert "eyJ" not in line and "X-SLURM" not in line
        wait_for(lambda: untrusted.refused, what="the proxy sees the refusal")
        assert untrusted.refused == ["TLSV1_ALERT_UNKNOWN_CA"] and untrusted.forwarded == 0

        out = cli({**env, "CLUSTEROPS_SLURM_URL": misnamed.url, "CLUSTEROPS_SLURM_CA_FILE": str(pki.ca)},
                  "slurm", "version")
        line = out.stderr.strip()
        assert out.returncode == 2 and len(line.splitlines()) == 1, (out.returncode, out.stderr)
        assert f"slurmrestd at {misnamed.url}: GET /openapi/v3: the server's TLS certificate was refused " \
               f"(IP address mismatch, certificate is not valid for '127.0.0.1')" in line, line
        assert "eyJ" not in line
        wait_for(lambda: misnamed.refused, what="the proxy sees the refusal")
        assert misnamed.refused == ["SSLV3_ALERT_BAD_CERTIFICATE"] and misnamed.forwarded == 0
        # The CA that signed it is trusted (the same run with the right name works).
        ok = cli({**env, "CLUSTEROPS_SLURM_CA_FILE": str(pki.ca)}, "slurm", "version")
        assert ok.returncode == 0 and untrusted.forwarded >= 1, ok.stderr
    assert untrusted.errors == [] and misnamed.errors == []
