"""The dev cluster's typed gres: ``gpu_type`` declares ``gpu:<type>:N`` in slurm.conf and
``Type=`` in gres.conf (so a node can say it has AMD GPUs); an untyped cluster is as before;
a type Slurm would split, or one without counted GPUs, is refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterops.devcluster import DevClusterConfig, render_gres_conf, render_slurm_conf
from clusterops.errors import InputError


def test_typed_gres_in_both_files():
    cfg = DevClusterConfig(nodes=2, gpus_per_node=2, gpu_type="mi300x")
    cfg.validate()
    conf = render_slurm_conf(cfg, Path("/st"), "h")
    assert " Gres=gpu:mi300x:2 " in conf and "GresTypes=gpu" in conf
    assert render_gres_conf(cfg, Path("/st")) == "NodeName=node[1-2] Name=gpu Type=mi300x File=/st/dev/gpu[0-1]\n"


def test_untyped_gres_unchanged():
    cfg = DevClusterConfig(nodes=2, gpus_per_node=4)
    assert " Gres=gpu:4 " in render_slurm_conf(cfg, Path("/st"), "h")
    assert render_gres_conf(cfg, Path("/st")) == "NodeName=node[1-2] Name=gpu File=/st/dev/gpu[0-3]\n"


@pytest.mark.parametrize("bad", ["", "mi300x:8", "a,b", "has space", "x(1)", "9lead", "a" * 33, "\u00e9"])
def test_bad_types_refused_naming_the_option(bad):
    with pytest.raises(InputError, match="--gpu-type"):
        DevClusterConfig(nodes=1, gpus_per_node=1, gpu_type=bad).validate()


def test_a_type_needs_counted_gpus():
    with pytest.raises(InputError, match="--gpus-per-node"):
        DevClusterConfig(nodes=1, gpus_per_node=0, gpu_type="mi300x").validate()
