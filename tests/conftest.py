import os
import sys

import pytest

# Keep the token cache of the whole test session in one temporary folder.
@pytest.fixture(scope="session", autouse=True)
def token_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    os.environ["MLX_DILOCO_CACHE"] = str(path)
    yield path


def tiny_config(**overrides):
    """A config that trains in about a second: the tiny GPT on the embedded corpus."""
    from dataclasses import fields
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.strategies import strategy_class
    params = dict(model="tiny", seq_len=16, batch_size=4, workers=2, steps=12, warmup=2, eval_batches=2)
    if "sync_every" in {f.name for f in fields(strategy_class(overrides.get("strategy", "diloco")))}:
        params["sync_every"] = 4
    params.update(overrides)
    return TrainConfig.from_dict(params)


def run_cli(*args, timeout=300, cwd=None, env=None):
    """Run the real `mlx-diloco` command line in a fresh process."""
    import subprocess
    return subprocess.run([sys.executable, "-m", "mlx_diloco", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})
