"""mlx-diloco: DiLoCo training across Apple Silicon Macs, and a simulator of such clusters.

The Python API (imported on first use, so that the command line starts without MLX):

    from mlx_diloco import Trainer, DiLoCo, DDP, FedAvg, SPARTA, DeMo, MuLoCo, SPARTADiLoCo
    from mlx_diloco import SparseLoCo, DESLOC, Quorum, NoLoCo
"""

__version__ = "0.1.0"

_STRATEGIES = ("Strategy", "DDP", "FedAvg", "DiLoCo", "SPARTA", "DeMo", "MuLoCo", "SPARTADiLoCo",
               "SparseLoCo", "DESLOC", "Quorum", "NoLoCo")


def __getattr__(name):
    if name in ("Trainer", "FitResult"):
        from . import api
        return getattr(api, name)
    if name in _STRATEGIES:
        from . import strategies
        return getattr(strategies, name)
    raise AttributeError(f"module 'mlx_diloco' has no attribute '{name}'")
