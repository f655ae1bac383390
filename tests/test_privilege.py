"""The caller's Slurm privilege (clusterops.slurm.privilege), decided from real output.

The config lines are as `scontrol show config` prints them (22.05 dev cluster; a site's
slurmdbd setup spelled the same way), the refusals as scontrol prints them.
"""

from __future__ import annotations

import pytest

from clusterops.slurm import privilege as pv
from clusterops.sweep import SweepOptions

DEV_CONFIG = """Configuration data as of 2026-12-01T06:07:00
AccountingStorageBackupHost = (null)
AccountingStorageType   = accounting_storage/none
AuthInfo                = socket=/tmp/x/run/munge/munge.socket,cred_expire=10
SlurmUser               = root(0)
SlurmdUser              = root(0)
SLURM_VERSION           = 22.05.8
"""
SITE_CONFIG = """AccountingStorageType   = accounting_storage/slurmdbd
SlurmUser               = slurm(64030)
"""


def test_parse_config_and_slurm_user():
    cfg = pv.parse_config(DEV_CONFIG)
    assert cfg["AccountingStorageType"] == "accounting_storage/none"
    assert pv.slurm_user(cfg) == ("root", 0)
    assert pv.slurm_user(pv.parse_config(SITE_CONFIG)) == ("slurm", 64030)
    assert pv.slurm_user({}) == ("", None)
    assert "Configuration data as of 2026-12-01T06" not in cfg   # a line with spaces before '=' only


@pytest.mark.parametrize("text, level", [
    ("Administrator\n", pv.Level.ADMIN), ("Operator\n", pv.Level.OPERATOR), ("None\n", pv.Level.USER),
    ("", pv.Level.USER), ("\n  \n", pv.Level.USER),
])
def test_parse_admin_level(text, level):
    assert pv.parse_admin_level(text) == level


@pytest.mark.parametrize("uid, config, db, expected", [
    (0, DEV_CONFIG, None, pv.Level.SLURM_USER),                 # root is everything
    (1001, DEV_CONFIG, None, pv.Level.USER),                    # no database: a plain user
    (1001, DEV_CONFIG, pv.Level.ADMIN, pv.Level.USER),          # ... whatever else is claimed
    (64030, SITE_CONFIG, None, pv.Level.SLURM_USER),            # the SlurmUser
    (1001, SITE_CONFIG, pv.Level.OPERATOR, pv.Level.OPERATOR),  # the database decides
    (1001, SITE_CONFIG, pv.Level.ADMIN, pv.Level.ADMIN),
    (1001, SITE_CONFIG, None, None),                            # database not answering: unknown
])
def test_level_for(uid, config, db, expected):
    assert pv.level_for(uid, pv.parse_config(config), db) == expected


@pytest.mark.parametrize("text, refused", [
    ("slurm_update error: Invalid user id", True),                # 22.05, seen on the dev cluster
    ("slurm_update error: Access/permission denied", True),       # later versions
    ("scontrol: error: Unable to contact slurm controller (connect failure)", False),
    ("slurm_update error: Invalid node name specified", False),
])
def test_is_refusal(text, refused):
    assert pv.is_refusal(text) is refused


def test_levels_are_ordered_and_named():
    assert pv.Level.USER < pv.Level.OPERATOR < pv.Level.ADMIN < pv.Level.SLURM_USER
    assert [lv.word for lv in pv.Level] == ["user", "operator", "admin", "SlurmUser"]
    assert pv.PrivilegeError("x").exit_code == 2


@pytest.mark.parametrize("kw, changes", [
    ({}, True),                                   # via Slurm: rechecks resume drained nodes
    ({"dry_run": True}, False),
    ({"drain": True, "dry_run": True}, False),
    ({"via": "ssh"}, False),
    ({"via": "ssh", "drain": True}, True),
    ({"recheck_drained": False}, False),
    ({"recheck_drained": False, "drain": True}, True),
])
def test_which_sweeps_need_an_admin(kw, changes):
    assert SweepOptions(nodes="node1", **kw).changes_nodes() is changes
