"""Fine-tuning types (issue 23, item 2): lora and dora put mlx-lm's adapters on a frozen base (a
quantized one too: QLoRA), every strategy that makes sense trains and exchanges only the adapters,
the others say why not, and the memory estimate counts the adapters and the frozen base."""

import json
import shutil
from dataclasses import replace

import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_llama_folder
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.exchange.codecs import get_codec
from mlx_diloco.exchange.comm import SimCommunicator, exchange_plan
from mlx_diloco.machine.memory import MemoryOptions, estimate, trained_shape
from mlx_diloco.models.finetune import adapter_config, apply_fine_tune
from mlx_diloco.strategies import make_strategy
from mlx_diloco.training.callbacks import TrainingCallback
from mlx_diloco.training.resolve import resolve
from mlx_diloco.training.run import Run

HIDDEN, FFN, KV, LAYERS, RANK = 32, 64, 16, 4, 4  # KV: 1 key-value head of 16 dims


def tiny_llama(folder, quantize: bool = False):
    return tiny_llama_folder(folder, layers=LAYERS, quantize=quantize)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("q4"), quantize=True)


def lora_config(model, **overrides):
    return TrainConfig.from_dict({"model": str(model), "fine_tune_type": "lora", "num_layers": 2,
                                  "lora_rank": RANK, "seq_len": 16, "batch_size": 4, "workers": 2, "steps": 8,
                                  "warmup": 2, "eval_sequences": 4, "lr": 1e-2, **overrides})


def adapter_count(layers: int, rank: int = RANK) -> int:
    """LoRA's parameters on a llama block: (in + out) x rank for q, k, v, o, gate, up, down."""
    linears = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN)]
    return layers * sum((i + o) * rank for i, o in linears)


class Exchanges(TrainingCallback):
    def __init__(self):
        self.rows = []

    def on_sync_report(self, info):
        self.rows.append(info)


def train(config, tmp_path):
    """A run of `config` over simulated workers; (the run, the exchanges it made)."""
    exchanges = Exchanges()
    run = Run(config, tmp_path / "run", SimCommunicator(config.workers), log=lambda m: None, callbacks=[exchanges])
    run.train()
    return run, exchanges.rows


def weights(params) -> dict:
    """Flat numpy copies of a model's parameters (or a parameter tree)."""
    return {k: np.array(v) for k, v in tree_flatten(params.parameters() if isinstance(params, nn.Module) else params)}


@pytest.mark.parametrize("kind, leaves", [("lora", {"lora_a", "lora_b"}), ("dora", {"lora_a", "lora_b", "m"})])
def test_adapters_train_and_the_base_is_frozen(base, kind, leaves):
    from mlx_lm.utils import load_model
    model, _ = load_model(base)
    apply_fine_tune(model, lora_config(base, fine_tune_type=kind))
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert {k.rsplit(".", 1)[1] for k in trainable} == leaves
    assert {int(k.split(".")[2]) for k in trainable} == {2, 3}   # the last num-layers blocks
    dora_m = 2 * (2 * HIDDEN + 2 * KV + 2 * FFN + HIDDEN) if kind == "dora" else 0  # m: one value per output
    assert sum(v.size for v in trainable.values()) == adapter_count(2) + dora_m


def test_adapter_config_is_mlx_lm_s_shape():
    config = lora_config("x", lora_scale=10.0, lora_dropout=0.1)
    # mlx-lm's keys, and inside lora_parameters the two mlx-lm-lora writes there too (a superset of both)
    assert adapter_config(config) == {"fine_tune_type": "lora", "num_layers": 2,
                                      "lora_parameters": {"rank": RANK, "scale": 10.0, "dropout": 0.1,
                                                          "use_dora": False, "num_layers": 2}}
    assert adapter_config(TrainConfig())["lora_parameters"] is None  # full, as mlx_lm.lora writes it


def test_lora_keys_put_adapters_on_the_named_layers_only(base, tmp_path):
    """mlx-lm's lora_parameters.keys from a lora.yaml: adapters on those layers alone, and an
    adapter_config.json from which mlx-lm's own load_adapters rebuilds the same adapters."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model
    from mlx_diloco.models.adapters import save_adapters
    (tmp_path / "lora.yaml").write_text(
        f"model: {base}\nfine_tune_type: lora\nnum_layers: 2\n"
        "lora_parameters:\n  keys: [self_attn.q_proj, self_attn.v_proj]\n  rank: 4\n  scale: 10.0\n  dropout: 0.0\n")
    config = TrainConfig.from_file(tmp_path / "lora.yaml")
    model = apply_fine_tune(load_model(base)[0], config)
    adapters = {k for k, _ in tree_flatten(model.trainable_parameters())}
    assert adapters == {f"model.layers.{b}.self_attn.{p}_proj.lora_{ab}" for b in (2, 3) for p in "qv" for ab in "ab"}
    assert adapter_config(config)["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    save_adapters(tmp_path / "adapters", model.trainable_parameters(), {**adapter_config(config), "model": str(base)})
    rebuilt = load_adapters(load_model(base)[0], str(tmp_path / "adapters"))
    assert {k for k, _ in tree_flatten(rebuilt.parameters()) if ".lora_" in k} == adapters


def test_lora_keys_naming_no_layer_is_one_line(base):
    from mlx_lm.utils import load_model
    with pytest.raises(ConfigError) as e:
        apply_fine_tune(load_model(base)[0], lora_config(base, lora_keys="self_attn.q_proj, self_attn.x_proj"))
    assert "lora-keys: no layer 'self_attn.x_proj' in the model's blocks" in str(e.value)
    assert "self_attn.q_proj" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("strategy, options", [
    ("diloco", {"sync_every": 4}), ("diloco", {"sync_every": 4, "fragments": 2}), ("fedavg", {"sync_every": 4}),
    ("ddp", {}), ("sparta", {"fraction": 0.1}), ("sparta-diloco", {"sync_every": 4}), ("demo", {})])
def test_strategies_train_only_the_adapters(base, tmp_path, strategy, options):
    from mlx_lm.utils import load_model
    config = lora_config(base, strategy=strategy, **options)
    run, rows = train(config, tmp_path)
    model = run.workers.model
    frozen = {k for k, _ in tree_flatten(model.parameters())} - {k for k, _ in tree_flatten(model.trainable_parameters())}
    before, after = weights(load_model(base)[0]), weights(model)
    assert all(np.array_equal(after[k], before[k.replace(".linear.", ".")]) for k in frozen)
    trained = weights(run.workers.params)  # the replicas' (the model holds placeholders between uses)
    assert set(trained) == {k for k, _ in tree_flatten(model.trainable_parameters())}
    assert np.abs(trained["model.layers.3.mlp.down_proj.lora_b"]).max() > 0   # starts at zero: it trained
    assert np.isfinite(run.summary()["final_eval_loss"])
    # What travels is the adapters, never the base: at most one adapter-sized message per exchange.
    assert rows and max(r["payload_bytes"] for r in rows) <= get_codec("fp32").wire_bytes(adapter_count(2))


@pytest.mark.parametrize("compress", ["fp16", "int8"])
def test_bytes_per_sync_are_the_adapters_in_the_codec(base, tmp_path, compress):
    """DiLoCo's pseudo-gradient: the adapters' count in the codec, and nothing of the base. fp16:
    2 bytes a value (its 4-byte scale travels in the pre-exchange check, as for any model)."""
    run, rows = train(lora_config(base, strategy="diloco", sync_every=4, compress=compress), tmp_path)
    T = adapter_count(2)
    _, _, payload, sent = exchange_plan(get_codec(compress), T, 2)
    assert [(r["payload_bytes"], r["sent_bytes"]) for r in rows] == [(payload, sent)] * 2
    if compress == "fp16":
        assert payload == T * 2


def test_qlora_trains_adapters_on_a_frozen_quantized_base(quantized, tmp_path):
    from mlx_lm.utils import load_model
    run, rows = train(lora_config(quantized, strategy="diloco", sync_every=4), tmp_path)
    model = run.workers.model
    assert isinstance(model.layers[3].self_attn.q_proj.linear, nn.QuantizedLinear)
    before, after = weights(apply_fine_tune(load_model(quantized)[0], lora_config(quantized))), weights(model)
    assert all(np.array_equal(after[k], before[k]) for k in before if "lora" not in k)
    assert rows[0]["payload_bytes"] == adapter_count(2) * 2
    assert np.isfinite(run.summary()["final_eval_loss"])
    with pytest.raises(ConfigError, match="quantized model trains adapters only"):
        Run(replace(lora_config(quantized), fine_tune_type="full"), tmp_path / "full", SimCommunicator(2),
            log=lambda m: None)


@pytest.mark.parametrize("overrides, message", [
    ({"model": "tiny"}, "needs an mlx-lm model"),                       # our GPT: no `layers`
    ({"strategy": "muloco"}, "Muon steps the blocks' weight matrices"),
    ({"fragments": 3}, "3 fragments but only 2 blocks"),
    ({"fine_tune_type": "qlora"}, "fine-tune-type must be one of full, lora, dora"),
])
def test_what_does_not_fit_adapters_is_one_line(base, overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve(lora_config(overrides.pop("model", base), **overrides))


def test_num_layers_above_the_blocks_puts_adapters_on_all_of_them_said_once(base, tmp_path):
    """mlx-lm's linear_to_lora_layers takes every block when num-layers is above their count; the
    default of 16 refused every smaller model. The note comes once, from sim, not from each process."""
    import mlx.core as mx
    from conftest import run_cli
    out = run_cli("sim", "--model", base, "--fine-tune-type", "lora", "--lora-rank", RANK, "--seq-len", 16,
                  "--batch-size", 4, "--workers", 2, "--processes", 2, "--steps", 2, "--warmup", 0, "--eval-sequences", 4,
                  "--sample-tokens", 0, "--run-dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr[-2000:]
    note = f"num-layers 16 is more than the model's {LAYERS} blocks: adapters on all {LAYERS}, as mlx-lm puts them"
    assert (out.stdout + out.stderr).count(note) == 1, out.stdout + out.stderr
    adapters = tmp_path / "run" / "adapters"
    assert json.loads((adapters / "adapter_config.json").read_text())["num_layers"] == LAYERS
    assert sum(v.size for v in mx.load(str(adapters / "adapters.safetensors")).values()) == adapter_count(LAYERS)


@pytest.mark.parametrize("fine_tune, data", [("lora", "chat"), ("full", "chat"), ("full", "text")])
def test_a_model_folder_without_its_tokenizer_is_one_line(base, tmp_path, fine_tune, data):
    """It was a 49-line traceback from transformers; now one line naming the folder and the files."""
    from conftest import run_cli
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*"))
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "train.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    (tmp_path / "text.txt").write_text("the user asks and the assistant answers\n" * 100)
    out = run_cli("sim", "--model", folder, "--data", tmp_path / ("chat" if data == "chat" else "text.txt"),
                  "--fine-tune-type", fine_tune, "--workers", 1, "--steps", 1, "--seq-len", 16, "--batch-size", 1,
                  "--run-dir", tmp_path / "run")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        f"mlx-diloco: error: {folder} has no tokenizer: none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
        "vocab.json, merges.txt is there; copy the tokenizer's files in from where the model came from, or pass "
        "--tokenizer FOLDER"), out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_memory_counts_the_adapters_and_the_frozen_base(base, quantized):
    strategy = make_strategy("diloco", {})
    full_spec, full = trained_shape(replace(lora_config(base), fine_tune_type="full"))
    _, lora = trained_shape(lora_config(base))
    _, qlora = trained_shape(lora_config(quantized))
    assert full.trainable is None and lora.trainable == qlora.trainable == adapter_count(2)
    # The frozen base: fp32 as stored (4 bytes a value), in bf16 2; 4-bit packed far less.
    assert lora.frozen_bytes == {"fp32": full.parameters * 4, "bf16": full.parameters * 2}
    assert qlora.frozen_bytes["fp32"] < lora.frozen_bytes["fp32"] / 3
    o = MemoryOptions.of(lora_config(base), strategy)
    est, est_full = estimate(lora, o), estimate(full, o)
    T = adapter_count(2)
    assert est["weights"] == T * 4 + full.parameters * 4
    assert (est["gradients"], est["moments"], est["outer state"]) == (T * 4, 2 * T * 4, strategy.outer_copies * T * 4)
    assert est["total"] < est_full["total"] and estimate(qlora, o)["total"] < est["total"]
