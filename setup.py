"""The package list for setuptools; everything else is declared in setup.cfg.

``packages = find:`` in setup.cfg finds only real directories, so it cannot also name the
data packages that setup.cfg's ``package_dir`` maps from the top of the repository
(``clusterops.templates`` = ``templates/`` and the rest). Here the list is both: every
code package under ``clusterops/`` found on disk, so a new one can never be left out of
the wheel, and every data package setup.cfg maps, read from setup.cfg itself.
"""

import configparser
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def data_packages():
    cfg = configparser.ConfigParser()
    cfg.read(HERE / "setup.cfg")
    mapping = cfg.get("options", "package_dir", fallback="")
    return sorted(line.split("=")[0].strip() for line in mapping.splitlines() if "=" in line)


setup(packages=find_packages(where=str(HERE), include=["clusterops", "clusterops.*"]) + data_packages())
