import inspect
import os
import sys

import pytest

# A test that compares two float computations (vmapped and not, a cluster and sim, a run and a number
# measured on one machine) must hold under every OpenBLAS kernel: another CPU's sums in another order
# (OPENBLAS_CORETYPE). `scripts/test --blas-kernels` runs the tests marked `blas` under each kernel.
# A test is marked by what it calls (FLOAT_COMPARISONS); mark one by hand (@pytest.mark.blas) that
# compares through a helper of its own, and @pytest.mark.measured one whose comparison is of a
# measurement (a rate, a time: the machine's load moves it, not a kernel). A tolerance is measured
# from the kernels' spread (docs/layout.md).
FLOAT_COMPARISONS = ("assert_allclose", "approx(", "allclose(", "isclose(", "assert_same_arrays", "assert_same(",
                     "assert_array_equal", "assert_trees_close", "assert_same_params", "assert_final_loss")


def pytest_configure(config):
    config.addinivalue_line("markers", "blas: compares float computations, so must hold under every OpenBLAS kernel "
                                       "(scripts/test --blas-kernels)")
    config.addinivalue_line("markers", "measured: compares a measurement (a rate, a time), not float computations")


def pytest_collection_modifyitems(items):
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and not item.get_closest_marker("measured") and \
                any(name in inspect.getsource(function) for name in FLOAT_COMPARISONS):
            item.add_marker(pytest.mark.blas)


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
    params = dict(model="tiny", seq_len=16, batch_size=4, workers=2, steps=12, warmup=2, eval_sequences=8)
    if "sync_every" in {f.name for f in fields(strategy_class(overrides.get("strategy", "diloco")))}:
        params["sync_every"] = 4
    params.update(overrides)
    return TrainConfig.from_dict(params)


def resumed_run(config, folder, stop_after: int):
    """`config` trained in `folder` until cut off after `stop_after` steps (as a killed process
    would be), then a new Run resumed from its last checkpoint, not yet trained on."""
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.training.run import Run
    Run(config, folder, SimCommunicator(config.workers), log=lambda m: None).train(stop_after=stop_after)
    return Run(config, folder, SimCommunicator(config.workers), resume=True, log=lambda m: None)


def assert_same_arrays(a, b):
    """Two trees of arrays hold the same keys and bit-identical values."""
    import numpy as np
    from mlx.utils import tree_flatten
    a, b = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.array(a[k]), np.array(b[k]), err_msg=k)


def run_cli(*args, timeout=300, cwd=None, env=None):
    """Run the real `mlx-diloco` command line in a fresh process."""
    import subprocess
    return subprocess.run([sys.executable, "-m", "mlx_diloco", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_llama_folder(folder, layers: int = 2, quantize: bool = False, corpus: str = None):
    """A random llama (hidden 32, MLP 64, one key-value head of 16) saved as mlx-lm saves models
    (4-bit with `quantize`), with a byte-level BPE tokenizer trained on `corpus` that has a chat
    template: what the fine-tuning tests start from, with nothing downloaded."""
    import json
    from dataclasses import asdict
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import quantize_model, save_config, save_model
    from mlx_diloco.data.datasets import train_bpe
    train_bpe(corpus or "the user asks and the assistant answers the question\n" * 50, 300, folder)
    tok_config = folder / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()), "chat_template": CHAT_TEMPLATE}))
    args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=layers, intermediate_size=64,
                     num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=320,
                     max_position_embeddings=256, tie_word_embeddings=False)
    mx.random.seed(0)
    model = Model(args)
    config = {k: v for k, v in asdict(args).items() if v is not None}
    if quantize:
        model, config = quantize_model(model, config, group_size=32, bits=4)
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(config, folder / "config.json")
    return folder


def addition_task(root):
    """The addition task's data (gym/addition.py, a few sums) and, in root/model, a random tiny Llama
    over its tokenizer (an mlx-lm folder): what the post-training tests start from, nothing trained."""
    from dataclasses import asdict
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model
    from mlx_diloco.gym.addition import write_data, write_tokenizer
    model_dir = write_tokenizer(root / "model")
    args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=16,
                     max_position_embeddings=64, tie_word_embeddings=False)
    mx.random.seed(0)
    model = Model(args)
    mx.eval(model.parameters())
    save_model(model_dir, model)
    save_config({k: v for k, v in asdict(args).items() if v is not None}, model_dir / "config.json")
    write_data(root, train=64, valid=16)
    return root
