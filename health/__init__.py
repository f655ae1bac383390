"""Health profiles (YAML), installed as package data (see setup.cfg)."""
