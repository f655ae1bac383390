"""Slurm-side files (HealthCheckProgram wrapper, prolog/epilog, slurm.conf lines, the sweep's cron
entry and systemd units), installed as package data (see setup.cfg); `clusterops deploy files`
writes them out for a site."""
