"""What a worker needs of a machine and gets from it, MLX-free at import: its memory (memory.py:
the estimate `plan`, `doctor` and the launcher print), its FLOPs and utilisation against the
device's peak, and when its process started (utilisation.py)."""
