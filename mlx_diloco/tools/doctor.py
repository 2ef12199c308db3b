"""`mlx-diloco doctor`: what a user needs to know about this machine before training."""

import os
import platform
import sys
from .. import __version__, blas
from ..cluster import hostinfo
from ..machine.utilisation import matmul_gflops, peak_gflops


def report() -> list:
    import mlx.core as mx
    lines = [f"mlx-diloco {__version__}, Python {sys.version.split()[0]}, {platform.platform()}",
             f"mlx {mx.__version__}, default device {mx.default_device()}",
             f"memory: {hostinfo.memory_bytes() / 1e9:.1f} GB, CPU cores: {os.cpu_count()}"]
    if mx.metal.is_available():
        info = mx.metal.device_info()
        lines.append(f"Metal GPU: {info.get('device_name', '?')}, "
                     f"recommended working set {info.get('max_recommended_working_set_size', 0) / 1e9:.1f} GB")
    now = matmul_gflops()
    lines.append(f"matmul 1024x1024 float32: {now:.1f} GFLOP/s; the peak runs' MFU divides by, the best "
                 f"measured here: {peak_gflops(beaten_by=now):.1f}")
    if sys.platform.startswith("linux"):
        if blas.openblas_preloaded():
            lines.append("BLAS: OpenBLAS preloaded (fast path)")
        else:
            lines.append(f"BLAS: MLX's bundled reference BLAS (~40x slow matmul); fix: {blas.FIX}")
    backends = [b for b in ("ring", "mpi", "jaccl", "nccl") if _backend_available(mx, b)]
    lines.append(f"distributed backends: {', '.join(backends) or 'none'}")
    return lines + preset_lines()


def preset_lines() -> list:
    """Which model presets one worker can train here (plan's memory estimate; language models at
    batch 4 x 512 tokens, image models at batch 4; a quantized preset's LoRA adapters)."""
    from ..config import TrainConfig
    from ..machine.memory import GB, MemoryOptions, estimate, flags, make_it_fit, trained_shape
    from ..models.zoo import load_spec, preset_names
    from ..strategies import make_strategy
    budget = hostinfo.training_memory()
    strategy = make_strategy(TrainConfig.strategy, {})  # sim's, with its defaults
    as_is, changed, too_large = [], [], []
    for preset in preset_names():
        spec = load_spec(preset)
        quantized = "quantization" in spec.params  # its packed weights cannot train: adapters only (QLoRA)
        name = preset + (" (images)" if not spec.is_language_model else " (LoRA)" if quantized else "")
        config = TrainConfig(model=preset, batch_size=4, fine_tune_type="lora" if quantized else "full",
                             num_layers=min(spec.num_blocks, 16),  # mlx-lm's default, or every block
                             seq_len=min(spec.context_length, 512) if spec.is_language_model else 0)
        o = MemoryOptions.of(config, strategy)
        _, shape = trained_shape(config)
        fix = make_it_fit(shape, o, budget)
        if fix == o:
            as_is.append(name)
        elif fix:
            changed.append(f"{name} with {flags(o, fix)} ({estimate(shape, fix)['total'] / GB:.1f} GB)")
        else:
            too_large.append(name)
    lines = [f"presets one worker can train here in fp32 ({budget / GB:.1f} GB for training; language models at "
             f"batch 4 x up to 512 tokens, image models at batch 4): {', '.join(as_is) or 'none'}"]
    lines += [f"  {c}" for c in changed]
    if too_large:
        lines.append(f"  too large here: {', '.join(too_large)}")
    return lines


def _backend_available(mx, backend: str) -> bool:
    try:
        return bool(mx.distributed.is_available(backend))
    except (TypeError, ValueError):
        return False
