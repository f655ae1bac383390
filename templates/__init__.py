"""Jinja2 sbatch templates, installed as package data (see setup.cfg)."""
