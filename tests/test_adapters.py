"""A fine-tune's output as mlx-lm reads it (issue 23, item 3): adapters that mlx_lm loads with the
same logits as our model with them, fused by `export --fuse` and by mlx_lm's fuse CLI, and mlx_lm's generate CLI on them."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import run_cli, tiny_config, tiny_llama_folder
from mlx_diloco.models import adapters

LORA = {"rank": 4, "scale": 20.0, "dropout": 0.0}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def adapted_model(base, fine_tune_type: str, num_layers: int = 1):
    """Our side: the base model, frozen, with mlx-lm's adapter layers (or its last layers
    unfrozen, for full), their weights moved off their start so that the adapters matter."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model
    model, _ = load_model(base)
    model.freeze()
    if fine_tune_type == "full":
        for layer in model.layers[-num_layers:]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, num_layers, LORA, use_dora=fine_tune_type == "dora")
    mx.random.seed(1)
    model.update(tree_map(lambda p: p + 0.05 * mx.random.normal(p.shape), model.trainable_parameters()))
    mx.eval(model.parameters())
    config = {"model": str(base), "fine_tune_type": fine_tune_type, "num_layers": num_layers,
              "lora_parameters": None if fine_tune_type == "full" else LORA}
    return model, config


TOKENS = mx.array([[5, 17, 42, 99, 3, 250, 7, 61]])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora", "full"])
def test_mlx_lm_loads_our_adapters_with_identical_logits(base, tmp_path, fine_tune_type):
    from mlx_lm.utils import load
    model, config = adapted_model(base, fine_tune_type)
    folder = adapters.save_adapters(tmp_path / "run" / adapters.ADAPTERS, model.trainable_parameters(), config)
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["model"] == str(base.resolve()) and saved["fine_tune_type"] == fine_tune_type
    assert set(mx.load(str(folder / "adapters.safetensors"))) == {k for k, _ in tree_flatten(model.trainable_parameters())}

    theirs, _ = load(str(base), adapter_path=str(folder))
    ours_logits, their_logits = model(TOKENS), theirs(TOKENS)
    assert np.abs(np.array(ours_logits - their_logits)).max() <= 1e-6
    plain, _ = load(str(base))  # the adapters change the model: the check above can fail
    assert np.abs(np.array(plain(TOKENS) - their_logits)).max() > 1e-3


def test_export_fuse_gives_a_folder_mlx_lm_loads_with_the_same_logits(base, tmp_path):
    from mlx_lm.utils import load
    model, config = adapted_model(base, "lora", num_layers=2)
    adapters.save_adapters(tmp_path / "run" / adapters.ADAPTERS, model.trainable_parameters(), config)
    out = run_cli("export", tmp_path / "run", tmp_path / "fused", "--fuse", env=OFFLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    fused, tokenizer = load(str(tmp_path / "fused"))
    assert not any("lora" in k for k, _ in tree_flatten(fused.parameters()))  # plain linears: fused in
    assert tokenizer.has_chat_template
    assert np.abs(np.array(fused(TOKENS) - model(TOKENS))).max() <= 1e-5

    out = run_cli("export", tmp_path / "run", tmp_path / "adapters-copy", env=OFFLINE)  # no --fuse: the adapters
    assert out.returncode == 0 and (tmp_path / "adapters-copy" / "adapters.safetensors").is_file(), out.stderr[-2000:]


def test_fuse_of_a_run_without_adapters_says_so(tmp_path):
    (tmp_path / "run").mkdir()
    out = run_cli("export", tmp_path / "run", tmp_path / "out", "--fuse")
    assert out.returncode == 2 and "has no adapters/ folder" in out.stderr and "drop --fuse" in out.stderr


def test_mlx_lm_generate_cli_runs_offline_on_our_adapters(base, tmp_path):
    model, config = adapted_model(base, "lora")
    folder = adapters.save_adapters(tmp_path / "adapters", model.trainable_parameters(), config)
    out = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(base), "--adapter-path",
                          str(folder), "--prompt", "the question", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert out.returncode == 0, out.stderr[-2000:]


def test_mlx_lm_fuse_cli_fuses_our_adapters_into_a_model_with_the_same_logits(base, tmp_path):
    """mlx-lm's own `fuse` command, as a user would run it on RUN/adapters."""
    from mlx_lm.utils import load
    model, config = adapted_model(base, "lora", num_layers=2)
    folder = adapters.save_adapters(tmp_path / "adapters", model.trainable_parameters(), config)
    out = subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(base), "--adapter-path", str(folder),
                          "--save-path", str(tmp_path / "fused")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert out.returncode == 0, out.stderr[-2000:]
    fused, _ = load(str(tmp_path / "fused"))
    assert not any("lora" in k for k, _ in tree_flatten(fused.parameters()))
    assert np.abs(np.array(fused(TOKENS) - model(TOKENS))).max() <= 1e-5


def test_generate_of_a_chat_run_goes_through_the_chat_template(base, tmp_path):
    from mlx_diloco.tools.generate import default_prompt, generate, trained_on_chat
    from mlx_lm.utils import load_tokenizer
    run = tmp_path / "run"
    model, config = adapted_model(base, "lora")
    adapters.save_adapters(run / adapters.ADAPTERS, model.trainable_parameters(), config)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (run / "config.json").write_text(json.dumps({"data": str(tmp_path / "chat.jsonl"), "seq_len": 32}))
    assert trained_on_chat(run)
    assert default_prompt(run) == "hi"  # sim's sample after a chat run: the first chat's user message
    tok = load_tokenizer(base)
    templated = tok.encode("<|user|>the question<|endoftext|><|assistant|>", add_special_tokens=False)
    greedy = "".join(generate(run, "the question", max_tokens=3, temperature=0))
    logits = model(mx.array([templated]))[0, -1]  # our model's first greedy token after the template
    assert greedy.startswith(tok.decode([mx.argmax(logits).item()]))


def test_a_lora_run_writes_its_global_adapters_that_mlx_lm_loads(base, tmp_path):
    """End to end: a DiLoCo LoRA run on the base folder writes RUN/adapters at each checkpoint, and
    mlx_lm's loader gives the logits of the run's own model with the checkpoint's global adapters."""
    from mlx_lm.utils import load, load_model
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.tools.export import global_parameters
    from mlx_diloco.models.finetune import apply_fine_tune
    from mlx_diloco.training import checkpoint
    from mlx_diloco.training.run import Run
    (tmp_path / "text.txt").write_text("the user asks and the assistant answers the question\n" * 200)
    config = tiny_config(model=str(base), data=str(tmp_path / "text.txt"), fine_tune_type="lora", num_layers=1,
                         steps=4, sync_every=2, batch_size=2, eval_sequences=2, lr=1e-2)
    Run(config, tmp_path / "run", SimCommunicator(2), log=lambda m: None).train()

    arrays, meta = checkpoint.load(tmp_path / "run")
    ours, _ = load_model(base)
    apply_fine_tune(ours, TrainConfig.from_dict(meta["config"]))
    ours.update(global_parameters(ours, arrays, meta))
    theirs, _ = load(str(base), adapter_path=str(tmp_path / "run" / adapters.ADAPTERS))
    assert np.abs(np.array(ours(TOKENS) - theirs(TOKENS))).max() <= 1e-6
    plain, _ = load(str(base))  # trained: the adapters moved off their zero start
    assert np.abs(np.array(plain(TOKENS) - theirs(TOKENS))).max() > 1e-4
