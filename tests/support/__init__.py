"""Test tooling shared by the tests, the demo (examples/demo.py) and the benchmarks:
not part of the installed package."""
