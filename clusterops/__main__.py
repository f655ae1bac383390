"""``python -m clusterops``: the same CLI as the ``clusterops`` command."""

from clusterops.cli import main

if __name__ == "__main__":  # pragma: no cover - thin entry point
    main()
