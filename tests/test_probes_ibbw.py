"""ib_write_bw between node pairs: the argv, the parser on recorded outputs, the floors,
one side run for real through the runner against a stand-in ``ib_write_bw`` on PATH (this
machine has no HCA), and the pair's combined verdict."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from clusterops.health.probes import ibbw
from clusterops.runner import Runner

FIX = Path(__file__).parent / "fixtures" / "ibbw"
SYSFS = Path(__file__).parent / "fixtures" / "fabric" / "healthy" / "t0"


def _text(name: str) -> str:
    return (FIX / name).read_bytes().decode("utf-8", errors="replace")


def test_argv_server_and_client_agree_and_only_the_client_names_the_peer():
    s = ibbw.perftest_argv("server", device="mlx5_0", size_bytes=65536, iters=100)
    c = ibbw.perftest_argv("client", device="mlx5_0", size_bytes=65536, iters=100, peer="10.0.0.1", gpu=3)
    assert s == ["ib_write_bw", "-d", "mlx5_0", "-i", "1", "-p", "18515", "-s", "65536", "-n", "100",
                 "-F", "--report_gbits"]
    assert c == s + ["--use_cuda=3", "10.0.0.1"]
    with pytest.raises(ValueError):
        ibbw.perftest_argv("client", device="mlx5_0")
    with pytest.raises(ValueError):
        ibbw.perftest_argv("both", device="mlx5_0")


def test_parse_healthy_ndr_passes_against_azure_floor():
    p = ibbw.parse_output(_text("ndr_healthy_client.txt"))
    assert p.ok and p.avg_gbps == 393.87 and p.peak_gbps == 394.52 and p.msg_bytes == 1048576
    assert p.iterations == 2000 and p.device == "mlx5_0"
    v = ibbw.judge(p, ibbw.floors_for("NDR", 400.0))
    assert v["status"] == "pass" and v["gbps"] == 393.87


def test_parse_low_gpudirect_result_fails_with_the_floor_and_source():
    p = ibbw.parse_output(_text("ndr_gpudirect_low_client.txt"))
    assert p.ok and p.avg_gbps == 196.12
    v = ibbw.judge(p, ibbw.floors_for("NDR", 400.0))
    assert v["status"] == "fail" and "380" in v["detail"] and "Azure" in v["detail"]


def test_between_floor_and_warn_warns():
    p = ibbw.Parsed(ok=True, avg_gbps=385.0, device="mlx5_1")
    assert ibbw.judge(p, ibbw.floors_for("NDR", 400.0))["status"] == "warn"


def test_unknown_rate_uses_fractions_of_the_line_rate():
    f = ibbw.floors_for("HDR", 200.0)
    assert f["fail"] == 180.0 and f["warn"] == 190.0 and "clusterops" in f["source"]
    assert ibbw.judge(ibbw.Parsed(ok=True, avg_gbps=150.0), f)["status"] == "fail"


def test_connection_failure_fails_with_perftest_line():
    p = ibbw.parse_output(_text("connect_failed_client.txt"))
    assert not p.ok and p.kind == "connect" and "10.1.0.11:18515" in p.line
    v = ibbw.judge(p, ibbw.floors_for("NDR", 400.0))
    assert v["status"] == "fail" and "connection failed" in v["detail"]


def test_missing_device_is_skip_not_fail():
    p = ibbw.parse_output(_text("no_device.txt"))
    assert p.kind == "no_device"
    assert ibbw.judge(p, {})["status"] == "skip"


def test_garbage_is_fail_no_result():
    p = ibbw.parse_output(_text("garbage.txt"))
    assert not p.ok and p.kind == "garbage"
    assert ibbw.judge(p, {})["status"] == "fail"
    assert ibbw.parse_output("").kind == "garbage"


def test_timeout_fails():
    v = ibbw.judge(ibbw.Parsed(ok=False, device="mlx5_0"), {}, timed_out=True)
    assert v["status"] == "fail" and "timed out" in v["detail"]


# -- one side, run for real through the runner ----------------------------------------------

def _stand_in(tmp_path: Path, body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "ib_write_bw"
    exe.write_text(f"#!{sys.executable}\n{body}\n")
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


def test_no_hca_is_skip_with_reason_and_runs_nothing(tmp_path):
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(tmp_path / "none")),
                        env={"SLURM_PROCID": "1", "MASTER_ADDR": "x"})
    assert doc["status"] == "skip" and "no HCA" in doc["detail"] and doc["role"] == "client"
    assert json.loads((tmp_path / "r" / "client.json").read_text())["status"] == "skip"


def test_missing_ib_write_bw_is_skip(tmp_path):
    runner = Runner(env={"PATH": str(tmp_path / "empty")})
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS)),
                        runner=runner, env={"SLURM_PROCID": "0"})
    assert doc["status"] == "skip" and "not installed" in doc["detail"]


def test_client_runs_stand_in_and_judges_its_output(tmp_path):
    out = FIX / "ndr_healthy_client.txt"
    env = _stand_in(tmp_path, "import sys, json\n"
                              f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                              f"sys.stdout.write(open({str(out)!r}).read())")
    host = tmp_path / "host"
    (host / "dev").mkdir(parents=True)
    (host / "dev" / "nvidia0").write_text("")
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS),
                                             gpudirect=True, host_root=str(host), all_rails=False),
                        runner=Runner(env=env), env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert doc["status"] == "pass" and doc["gbps"] == 393.87 and doc["gpudirect"] is True
    assert doc["rails"] == ["mlx5_0/1"] and len(doc["results"]) == 1
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["-d", "mlx5_0"] and "--use_cuda=0" in argv and argv[-1] == "10.0.0.1"


def test_gpudirect_asked_without_a_gpu_runs_host_memory(tmp_path):
    env = _stand_in(tmp_path, "import sys, json\n"
                              f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                              f"sys.stdout.write(open({str(FIX / 'ndr_healthy_client.txt')!r}).read())")
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS),
                                             gpudirect=True, host_root=str(tmp_path)),
                        runner=Runner(env=env), env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert doc["gpudirect"] is False
    assert not any(a.startswith("--use_cuda") for a in json.loads((tmp_path / "argv.json").read_text()))


def test_a_hung_peer_times_out_as_fail(tmp_path):
    env = _stand_in(tmp_path, "import time\ntime.sleep(30)")
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS), timeout_s=1),
                        runner=Runner(env=env), env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert doc["status"] == "fail" and "timed out" in doc["detail"]


def test_server_success_is_pass_and_the_pair_takes_the_clients_figure(tmp_path):
    env = _stand_in(tmp_path, f"import sys\nsys.stdout.write(open({str(FIX / 'ndr_gpudirect_low_client.txt')!r}).read())")
    d = tmp_path / "r"
    ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(d), sysfs_root=str(SYSFS)), runner=Runner(env=env),
                  env={"SLURM_PROCID": "0"})
    ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(d), sysfs_root=str(SYSFS)), runner=Runner(env=env),
                  env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert json.loads((d / "server.json").read_text())["status"] == "fail"   # server saw the low figure too
    pair = ibbw.read_pair(d)
    assert pair["status"] == "fail" and pair["gbps"] == 196.12


def test_combine():
    ok = {"status": "pass", "gbps": 393.0, "detail": "x", "node": "a"}
    assert ibbw.combine({"status": "skip", "detail": "no HCA", "node": "a"}, None)["status"] == "skip"
    assert ibbw.combine(ok, None)["status"] == "fail"
    one = ibbw.combine(ok, {"status": "warn", "gbps": 385.0, "detail": "d", "gpudirect": True})
    assert {k: one[k] for k in ("status", "gbps", "detail", "gpudirect")} == {
        "status": "warn", "gbps": 385.0, "detail": "d", "gpudirect": True}
    assert ibbw.combine({"status": "error", "detail": "bad", "node": "a"}, ok)["status"] == "error"


def test_read_pair_with_no_files_is_error_with_the_step_log_and_a_torn_side_is_fail(tmp_path):
    (tmp_path / "nothing.err").write_text("srun: error: execve(): clusterops: No such file or directory\n")
    r = ibbw.read_pair(tmp_path / "nothing")
    assert r["status"] == "error" and "execve" in r["detail"]
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "client.json").write_text("{not json")
    (tmp_path / "torn" / "server.json").write_text(json.dumps({"status": "pass", "node": "a"}))
    assert ibbw.read_pair(tmp_path / "torn")["status"] == "fail"


def test_cli_ibbw_skips_on_this_machine_without_hca(tmp_path):
    from clusterops.cli import main as cli_main
    if Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()):
        pytest.skip("this machine has an HCA")
    with pytest.raises(SystemExit) as e:
        cli_main(["health", "ibbw", "--report-dir", str(tmp_path), "--role", "client", "--peer", "127.0.0.1"])
    assert e.value.code == 0
    assert json.loads((tmp_path / "client.json").read_text())["status"] == "skip"


def test_client_before_its_server_tries_again_until_it_connects(tmp_path, monkeypatch):
    monkeypatch.setattr(ibbw, "CONNECT_RETRY_S", 0.05)
    count = tmp_path / "count"
    env = _stand_in(tmp_path, "import sys, os\n"
                              f"p = {str(count)!r}\n"
                              "n = int(open(p).read()) + 1 if os.path.exists(p) else 1\n"
                              "open(p, 'w').write(str(n))\n"
                              f"name = 'connect_failed_client.txt' if n < 3 else 'ndr_healthy_client.txt'\n"
                              f"sys.stdout.write(open(os.path.join({str(FIX)!r}, name)).read())\n"
                              "sys.exit(1 if n < 3 else 0)")
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS), timeout_s=20,
                                             all_rails=False),
                        runner=Runner(env=env), env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert doc["status"] == "pass" and doc["results"][0]["attempts"] == 3


def test_client_that_never_connects_fails_by_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(ibbw, "CONNECT_RETRY_S", 0.05)
    env = _stand_in(tmp_path, f"import sys\nsys.stdout.write(open({str(FIX / 'connect_failed_client.txt')!r}).read())\n"
                              "sys.exit(1)")
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS), timeout_s=1.5,
                                             all_rails=False),
                        runner=Runner(env=env), env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert doc["status"] == "fail" and "connection failed" in doc["detail"]
    assert doc["results"][0]["attempts"] >= 2


# -- every rail -------------------------------------------------------------------------------

ROCE = Path(__file__).parent / "fixtures" / "fabric" / "roce" / "t0"
PORT_DOWN = Path(__file__).parent / "fixtures" / "fabric" / "port_down" / "t0"


def _recording_stand_in(tmp_path: Path, outputs: dict, default: str = "ndr_healthy_client.txt") -> dict:
    """A stand-in ib_write_bw that appends its argv to argv.jsonl and prints the recorded
    output named for its -d device (``outputs``: device -> fixture file name)."""
    return _stand_in(tmp_path, "import sys, json, os\n"
                               f"open({str(tmp_path / 'argv.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                               "dev = sys.argv[sys.argv.index('-d') + 1]\n"
                               f"name = {outputs!r}.get(dev, {default!r})\n"
                               f"sys.stdout.write(open(os.path.join({str(FIX)!r}, name)).read())")


def _argvs(tmp_path: Path) -> list:
    return [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]


def test_every_active_rail_is_tested_in_order_each_on_its_own_port(tmp_path):
    env = _recording_stand_in(tmp_path, {})
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(SYSFS)),
                        runner=Runner(env=env), env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1"})
    assert doc["rails"] == ["mlx5_0/1", "mlx5_1/1", "mlx5_2/1", "mlx5_3/1", "mlx5_4/1"]
    argvs = _argvs(tmp_path)
    assert [a[a.index("-d") + 1] for a in argvs] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4"]
    assert [int(a[a.index("-p") + 1]) for a in argvs] == [18515, 18516, 18517, 18518, 18519]
    assert [r["status"] for r in doc["results"]] == ["pass"] * 5
    assert doc["status"] == "pass" and doc["gbps"] == 393.87 and doc["detail"] == "5 rails, slowest 393.87 Gb/s"


def test_the_pair_verdict_is_the_worst_rail_and_names_it(tmp_path):
    env = _recording_stand_in(tmp_path, {"mlx5_2": "ndr_gpudirect_low_client.txt"})
    d = tmp_path / "r"
    for procid in ("0", "1"):
        ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(d), sysfs_root=str(SYSFS)), runner=Runner(env=env),
                      env={"SLURM_PROCID": procid, "MASTER_ADDR": "10.0.0.1", "SLURMD_NODENAME": f"n{procid}"})
    pair = ibbw.read_pair(d)
    assert pair["status"] == "fail" and pair["gbps"] == 196.12
    assert pair["detail"].startswith("mlx5_2: 196.12 Gb/s < floor 380 Gb/s")
    by_rail = {r["rail"]: r for r in pair["rails"]}
    assert set(by_rail) == {"mlx5_0/1", "mlx5_1/1", "mlx5_2/1", "mlx5_3/1", "mlx5_4/1"}
    assert by_rail["mlx5_2/1"]["status"] == "fail" and by_rail["mlx5_0/1"]["gbps"] == 393.87
    assert by_rail["mlx5_4/1"]["rate"] == "HDR" and by_rail["mlx5_4/1"]["link_layer"] == "Ethernet"


def test_a_rail_active_on_one_node_only_fails_the_pair(tmp_path):
    env = _recording_stand_in(tmp_path, {})
    d = tmp_path / "r"
    ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(d), sysfs_root=str(SYSFS)), runner=Runner(env=env),
                  env={"SLURM_PROCID": "0", "SLURMD_NODENAME": "n0"})
    ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(d), sysfs_root=str(PORT_DOWN)), runner=Runner(env=env),
                  env={"SLURM_PROCID": "1", "MASTER_ADDR": "10.0.0.1", "SLURMD_NODENAME": "n1"})
    pair = ibbw.read_pair(d)
    assert pair["status"] == "fail"
    assert "the nodes' rails differ: only n0 has ACTIVE mlx5_1/1" in pair["detail"]


def test_all_rails_false_and_devices_pick_the_rails(tmp_path):
    rails, seen = ibbw.pick_rails(SYSFS, all_rails=False)
    assert [r["rail"] for r in rails] == ["mlx5_0/1"] and seen == 5
    rails, _ = ibbw.pick_rails(SYSFS, devices=["mlx5_[23]"])
    assert [r["rail"] for r in rails] == ["mlx5_2/1", "mlx5_3/1"]
    rails, _ = ibbw.pick_rails(SYSFS, link_layers=["Ethernet"])
    assert [r["rail"] for r in rails] == ["mlx5_4/1"]


def test_ports_present_but_none_active_fails(tmp_path):
    rails, seen = ibbw.pick_rails(PORT_DOWN, devices=["mlx5_1"])
    assert rails == [] and seen == 1
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(PORT_DOWN),
                                             device="mlx5_1"), env={"SLURM_PROCID": "1", "MASTER_ADDR": "x"})
    assert doc["status"] == "fail" and "none of the 1 HCA ports" in doc["detail"]


# -- RoCE: the GID index ------------------------------------------------------------------

def test_gid_index_prefers_roce_v2_with_an_ipv4_mapped_address():
    assert ibbw.gid_index(ROCE, "mlx5_4", 1) == 3      # v1/v2 link-local at 0/1, IPv4 v1/v2 at 2/3
    assert ibbw.gid_index(ROCE, "mlx5_5", 1) == 1      # no IPv4: the first RoCE v2 entry
    assert ibbw.gid_index(ROCE, "mlx5_6", 1) is None   # RoCE v1 only: perftest's default
    assert ibbw.gid_index(ROCE, "mlx5_0", 1) is None   # no gids table (an IB fixture port)


def test_roce_rails_pass_x_and_infiniband_rails_do_not(tmp_path):
    env = _recording_stand_in(tmp_path, {})
    doc = ibbw.run_rank(ibbw.PairRankOptions(report_dir=str(tmp_path / "r"), sysfs_root=str(ROCE)),
                        runner=Runner(env=env), env={"SLURM_PROCID": "0"})
    argv = {a[a.index("-d") + 1]: a for a in _argvs(tmp_path)}
    assert "-x" not in argv["mlx5_0"]
    assert argv["mlx5_4"][argv["mlx5_4"].index("-x") + 1] == "3"
    assert argv["mlx5_5"][argv["mlx5_5"].index("-x") + 1] == "1"
    assert "-x" not in argv["mlx5_6"]
    assert [r["gid_index"] for r in doc["results"]] == [None, 3, 1, None]


def test_a_forced_gid_index_goes_to_roce_rails_only(tmp_path):
    rails, _ = ibbw.pick_rails(ROCE, gid=5)
    assert {r["rail"]: r["gid_index"] for r in rails} == {"mlx5_0/1": None, "mlx5_4/1": 5, "mlx5_5/1": 5,
                                                          "mlx5_6/1": 5}


# -- the profile's settings -----------------------------------------------------------------

def test_options_from_profile_and_the_command_line_over_them(tmp_path):
    cfg = {"timeout_s": 12, "all_rails": False, "devices": ["mlx5_*"], "gpudirect": True, "gpu": 2,
           "tcp_port": 20000, "size_bytes": 65536, "iters": 50, "gid_index": 3,
           "floors": {"HDR": {"fail": 150, "warn": 170}}, "fail_fraction": 0.5, "warn_fraction": 0.6}
    o = ibbw.options_from_profile(cfg, str(tmp_path), iters=7, gpudirect=None)
    assert (o.timeout_s, o.all_rails, o.devices, o.gpudirect, o.gpu, o.tcp_port, o.size_bytes, o.iters,
            o.gid_index) == (12.0, False, ("mlx5_*",), True, 2, 20000, 65536, 7, 3)
    f = ibbw.floors_for("HDR", 200.0, o.floors)
    assert (f["fail"], f["warn"]) == (150, 170) and "ibbw.floors.HDR" in f["source"]
    f = ibbw.floors_for("EDR", 100.0, o.floors)
    assert (f["fail"], f["warn"]) == (50.0, 60.0)
    assert ibbw.floors_for("NDR", 400.0, o.floors)["fail"] == 380.0      # the built-in one stays


def test_builtin_profiles_set_ibbw_and_health_check_never_runs_it():
    from clusterops.health import load_profile
    from clusterops.health.check import probe_specs

    fast, pre = load_profile("fast"), load_profile("preflight")
    assert fast.probes["ibbw"]["gpudirect"] is False and pre.probes["ibbw"]["gpudirect"] is True
    assert load_profile("deep").probes["ibbw"]["gpudirect"] is True
    assert "ibbw" not in {s.name for s in probe_specs(fast)}


def test_cli_takes_the_profiles_settings_and_the_flags_over_them(tmp_path):
    from clusterops.cli import main as cli_main

    prof = tmp_path / "p.yaml"
    prof.write_text(f"extends: fast\nprobes:\n  ibbw:\n    sys_root: {ROCE}\n    devices: [mlx5_4]\n"
                    "    tcp_port: 20000\n    iters: 11\n")
    env = _recording_stand_in(tmp_path, {})
    old = os.environ["PATH"]
    os.environ["PATH"] = env["PATH"]
    try:
        with pytest.raises(SystemExit) as e:
            cli_main(["health", "ibbw", "--profile", str(prof), "--report-dir", str(tmp_path / "r"),
                      "--role", "client", "--peer", "10.0.0.1", "--iters", "5"])
    finally:
        os.environ["PATH"] = old
    assert e.value.code == 0
    (argv,) = _argvs(tmp_path)
    assert argv[argv.index("-d") + 1] == "mlx5_4" and argv[argv.index("-p") + 1] == "20000"
    assert argv[argv.index("-n") + 1] == "5" and argv[argv.index("-x") + 1] == "3"
    doc = json.loads((tmp_path / "r" / "client.json").read_text())
    assert doc["status"] == "pass" and doc["rails"] == ["mlx5_4/1"]


def test_cli_with_ibbw_off_in_the_profile_runs_nothing_and_a_bad_profile_exits_2(tmp_path):
    from clusterops.cli import main as cli_main

    off = tmp_path / "off.yaml"
    off.write_text("extends: fast\nprobes:\n  ibbw: false\n")
    with pytest.raises(SystemExit) as e:
        cli_main(["health", "ibbw", "--profile", str(off), "--report-dir", str(tmp_path / "r")])
    assert e.value.code == 0 and not (tmp_path / "r").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("probes:\n  ibbw:\n    iters: 0\n")
    with pytest.raises(SystemExit) as e:
        cli_main(["health", "ibbw", "--profile", str(bad), "--report-dir", str(tmp_path / "r")])
    assert e.value.code == 2
