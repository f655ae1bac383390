"""``clusterops job watch`` without a job id (the cron pass, clusterops/jobwatch.py) on the real
dev cluster: a job made to restart in a loop (root's) and one made to stall (a second user's:
it trains and never commits a checkpoint). The user's pass sees only the user's job; root's
(an administrator's) sees both, tells a webhook, writes the metrics and cancels them."""

from __future__ import annotations

import json
import sys

import pytest

from support import faultkit as fk
from support import users
from support.webhook import Hook
from support.wait import wait_for
from clusterops.runner import Runner

pytestmark = pytest.mark.integration


def watch(*args, runner=None):
    return (runner or Runner()).run([sys.executable, "-m", "clusterops", "job", "watch", *args, "--json"],
                                    timeout_s=120, check=False, cwd="/")


def by_job(doc) -> dict:
    out: dict = {}
    for f in doc["flagged"]:
        out.setdefault(f["job_id"], set()).add(f["flag"])
    return out


@pytest.mark.timeout(600)
def test_restart_loop_and_stall_are_flagged_notified_and_cancelled(cluster, tmp_path):
    from clusterops.slurm.factory import connect

    slurm = connect()
    # --samples 1: every rank exits 1 right after joining the group; the budgets let it loop.
    loop = fk.TrainJob(root=tmp_path / "loop", name="cron-loop", nodes=2, steps=60, train_args=["--samples", "1"],
                       supervise={"no_progress_restarts": 50, "max_restarts": 50})
    loop_id = str(loop.submit())
    pw = users.ensure_user()
    hooks: list = []
    with users.python_reachable(pw.pw_name), users.user_dir(pw.pw_name) as home:
        as_user = Runner(env=cluster.env(), as_user=pw.pw_name)
        try:
            # Trains for ever and never reaches a checkpoint.
            stall = fk.TrainJob(root=home / "stall", name="cron-stall", nodes=2, steps=100000, ckpt_every=100000,
                                user=pw.pw_name)
            stall_id = str(stall.submit())
            stall.wait_step(5, timeout_s=240)

            def flagged():
                p = watch("--max-restarts", "2", "--window-s", "600", "--stall-s", "25")
                assert p.returncode in (0, 1), p.stderr
                got = by_job(json.loads(p.stdout))
                ok = "restart_storm" in got.get(loop_id, set()) and "stalled" in got.get(stall_id, set())
                return got if ok else None

            got = wait_for(flagged, 300, "both jobs flagged", interval_s=5,
                           detail=lambda: f"{loop.slurm_says(slurm)}; {stall.slurm_says(slurm)}")
            assert "restart_storm" not in got[stall_id], got
            # The user's own pass: their job only, not root's.
            p = watch("--max-restarts", "2", "--window-s", "600", "--stall-s", "25", runner=as_user)
            assert p.returncode == 1, p.stderr
            mine = by_job(json.loads(p.stdout))
            assert stall_id in mine and loop_id not in mine, mine
            # Root's pass with a webhook, the metrics and --cancel.
            hook = Hook()
            hooks.append(hook)
            conf = tmp_path / "notify.yaml"
            conf.write_text(f"notify:\n  - url: {hook.url}\n")
            prom = tmp_path / "watch.prom"
            p = watch("--max-restarts", "2", "--window-s", "600", "--stall-s", "25", "--cancel",
                      "--notify-config", str(conf), "--prometheus", str(prom))
            assert p.returncode == 1, p.stderr
            doc = json.loads(p.stdout)
            done = {(f["job_id"], f["flag"]) for f in doc["flagged"] if f["cancelled"]}
            assert (loop_id, "restart_storm") in done and (stall_id, "stalled") in done, doc
            events = [body for _, _, body in hook.got]
            assert {e["details"]["job_id"] for e in events if e["event"] == "job_flagged"} >= {loop_id, stall_id}, events
            text = prom.read_text()
            assert f'clusterops_watch_job_flagged{{flag="stalled",job="{stall_id}",user="{pw.pw_name}"}} 1.0' in text
            assert f'flag="restart_storm",job="{loop_id}",user="root"' in text, text
            for j in (loop, stall):
                info = j.wait_end(slurm, timeout_s=120)
                assert info.state == "CANCELLED", j.slurm_says(slurm)
            # Nothing left to flag.
            p = watch("--max-restarts", "2", "--window-s", "600", "--stall-s", "25")
            assert p.returncode == 0 and json.loads(p.stdout)["flagged"] == [], p.stdout
        finally:
            for h in hooks:
                h.close()
            Runner(env=cluster.env()).run(["scancel", "--full", f"--user={pw.pw_name}"], timeout_s=30, check=False)
