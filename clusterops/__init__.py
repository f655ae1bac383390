"""clusterops: Slurm cluster operations for large-scale PyTorch training.

Importing the package is cheap on purpose: nothing here pulls in torch, pynvml,
paramiko or rich. Submodules import what they need where they need it.
"""

__version__ = "0.1.0"
