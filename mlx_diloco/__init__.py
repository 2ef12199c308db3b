"""mlx-diloco: DiLoCo training across Apple Silicon Macs, and a simulator of such clusters."""

__version__ = "0.1.0"
