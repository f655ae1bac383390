"""Grafana dashboard and Prometheus alert rules, installed as package data (see setup.cfg);
`clusterops deploy files` writes them out for a site."""
