"""The Python API (issue 10): any MLX model, loss and data, any strategy, in a few lines."""

import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_diloco import DDP, SPARTA, DiLoCo, Trainer
from mlx_diloco.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 32), nn.Linear(32, 3)

    def __call__(self, x):
        return self.l2(nn.relu(self.l1(x)))


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def blobs(n=1200, seed=0):
    """Three Gaussian blobs in 8 dimensions: a problem any of the strategies learns in 100 steps."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype(np.int32)
    x = (rng.normal(size=(n, 8)) + 4.0 * np.eye(3, 8)[y]).astype(np.float32)
    return x, y


@pytest.mark.parametrize("strategy", [DDP(compress="fp32"), DiLoCo(sync_every=10), SPARTA(fraction=0.1)],
                         ids=lambda s: s.name)
def test_fit_any_model_with_any_strategy(tmp_path, strategy):
    mx.random.seed(0)
    x, y = blobs()
    result = Trainer(MLP(), loss_fn, (x[:1000], y[:1000]), (x[1000:], y[1000:]), batch_size=16, lr=3e-3,
                     warmup=5, eval_sequences=64, run_dir=tmp_path / "run", log=lambda m: None).fit(
        strategy, workers=4, steps=100)
    assert result.metrics[-1]["eval_loss"] < 0.5 * result.metrics[0]["eval_loss"]
    accuracy = (mx.argmax(result.model(mx.array(x[1000:])), axis=1) == mx.array(y[1000:])).mean().item()
    assert accuracy > 0.85 and result.bytes_sent > 0
    assert result.modelled_time("100mbit/20ms") > result.modelled_time("10gbe") >= result.summary["compute_s"]
    assert (tmp_path / "run" / "latest.json").exists()  # checkpoints as in sim


def test_iterable_batches_and_resume(tmp_path):
    x, y = blobs()
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 1000, 8)]
    settings = dict(lr=3e-3, warmup=5, eval_sequences=64, log=lambda m: None)
    model = MLP()  # every fit starts from a copy of it
    straight = Trainer(model, loss_fn, batches, (x[1000:], y[1000:]), **settings).fit(
        DiLoCo(sync_every=5), workers=2, steps=20, run_dir=tmp_path / "a")
    # The same run, cut short when its batches run out after 13 steps (the last checkpoint is at 10)...
    with pytest.raises(ConfigError, match="ran out after 13 steps"):
        Trainer(model, loss_fn, batches[:26], (x[1000:], y[1000:]), **settings).fit(
            DiLoCo(sync_every=5), workers=2, steps=20, run_dir=tmp_path / "b")
    # ...and resumed with all of them: the stream skips what the first 10 steps took.
    resumed = Trainer(model, loss_fn, batches, (x[1000:], y[1000:]), **settings).fit(
        DiLoCo(sync_every=5), workers=2, steps=20, run_dir=tmp_path / "b", resume=True)
    assert [r["step"] for r in resumed.metrics] == [r["step"] for r in straight.metrics]
    assert resumed.summary["final_eval_loss"] == straight.summary["final_eval_loss"]


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv2d(1, 4, 3), nn.Linear(4 * 6 * 6, 3)

    def __call__(self, x):
        return self.out(nn.relu(self.conv(x)).reshape(x.shape[0], -1))


class Windows(nn.Module):
    """The largest value of each overlapping window of 8 pixels, cut with mx.as_strided (which MLX
    cannot vmap), then a linear layer."""
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(15, 3)

    def __call__(self, x):
        flat = x.reshape(x.shape[0], 64)
        return self.out(mx.as_strided(flat, (flat.shape[0], 15, 8), (64, 4, 1)).max(axis=-1))


def test_a_model_mlx_cannot_vmap_trains_one_replica_after_another(tmp_path):
    x, y = blobs(400)
    images = np.repeat(x[:, None, :, None], 8, axis=1)  # (n, 8, 8, 1)
    said = []
    result = Trainer(Windows(), loss_fn, (images, y), batch_size=8, lr=1e-2, warmup=2, eval_sequences=16,
                     run_dir=tmp_path / "r", log=said.append).fit(DiLoCo(sync_every=4), workers=2, steps=8)
    assert sum("cannot be vmapped" in m for m in said) == 1 and result.metrics[-1]["step"] == 8


def test_a_convolutional_model_trains_vmapped_as_one_replica_after_another(tmp_path):
    """The gradients of vmapped losses (MLX cannot vmap a convolution's gradient, but can
    differentiate a vmapped convolution) train a CNN's replicas as one after another does."""
    x, y = blobs(400)
    images = np.repeat(x[:, None, :, None], 8, axis=1)
    said, finals = [], []
    for vectorize in (True, False):
        mx.random.seed(0)
        trainer = Trainer(ConvNet(), loss_fn, (images, y), batch_size=8, lr=1e-2, warmup=2, eval_sequences=16,
                          run_dir=tmp_path / f"v{vectorize}", log=said.append, vectorize=vectorize)
        finals.append(trainer.fit(DiLoCo(sync_every=4), workers=2, steps=8).metrics[-1]["eval_loss"])
    assert not any("cannot be vmapped" in m for m in said)
    assert finals[0] == pytest.approx(finals[1], rel=1e-4)


def test_a_new_strategy_in_one_short_file(tmp_path):
    """docs/strategies.md's example: DiLoCo with an outer Adam, in examples/outer_adam.py."""
    from outer_adam import OuterAdam
    assert len((ROOT / "examples" / "outer_adam.py").read_text().splitlines()) < 40
    x, y = blobs()
    result = Trainer(MLP(), loss_fn, (x, y), lr=1e-2, warmup=5, eval_sequences=64, run_dir=tmp_path / "r",
                     log=lambda m: None).fit(OuterAdam(sync_every=10), workers=2, steps=60)
    assert result.metrics[-1]["eval_loss"] < 0.5 * result.metrics[0]["eval_loss"]
    with pytest.raises(ConfigError, match="did you mean 'outer_beta2'"):
        OuterAdam(outer_beta=0.9)


def test_digits_example_runs():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "digits.py"), "--steps", "20", "--out",
                          str(ROOT / "runs" / "test-digits")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(name in out.stdout for name in ("ddp", "diloco", "sparta")) and "digits.png" in out.stdout


def test_a_model_builder_runs_from_the_command_line(tmp_path):
    """What runs through the API runs through sim, launch and the cluster worker too: --model module:function."""
    (tmp_path / "mymodels.py").write_text(
        "from mlx_diloco.models.gpt import GPT, GPTArgs\n\n"
        "def build():\n"
        "    return GPT(GPTArgs(vocab_size=512, context_length=32, n_layer=2, n_head=2, n_embd=32))\n\n"
        "build.preset = {'vocab_size': 512, 'context_length': 32}\n")
    from conftest import run_cli
    out = run_cli("sim", "--model", "mymodels:build", "--steps", "8", "--sync-every", "4", "--workers", "2",
                  "--batch-size", "4", "--eval-sequences", "8", "--run-dir", tmp_path / "r", "--sample-tokens", "3",
                  env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "final eval loss" in out.stdout and "sample:" in out.stdout
    bad = run_cli("sim", "--model", "nosuchmodule:build", "--run-dir", tmp_path / "x")
    assert bad.returncode == 2 and "cannot load model builder 'nosuchmodule:build'" in bad.stderr


def test_a_rebuildable_model_trains_in_processes_like_in_one(tmp_path, monkeypatch):
    """Issue 12: a builder, an importable loss and arrays go to K processes (sim --processes);
    a model object says once why it stays in one process."""
    (tmp_path / "blobmodels.py").write_text(
        "import mlx.nn as nn\n\n"
        "class MLP(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.l1, self.l2 = nn.Linear(8, 32), nn.Linear(32, 3)\n\n"
        "    def __call__(self, x):\n"
        "        return self.l2(nn.relu(self.l1(x)))\n\n"
        "def mlp():\n"
        "    return MLP()\n\n"
        "def loss(model, x, y):\n"
        "    return nn.losses.cross_entropy(model(x), y, reduction='mean')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import blobmodels
    x, y = blobs()
    said = []
    trainer = Trainer("blobmodels:mlp", blobmodels.loss, (x[:1000], y[:1000]), (x[1000:], y[1000:]), lr=3e-3,
                      warmup=5, eval_sequences=64, log=said.append)
    fits = [trainer.fit(DiLoCo(sync_every=10, compress="fp32"), workers=4, steps=30, processes=K,
                        run_dir=tmp_path / f"k{K}") for K in (1, 2)]
    assert any("in 2 processes" in m for m in said)
    assert (tmp_path / "k2" / "worker-2").is_dir()  # the second process checkpointed its workers there
    assert fits[1].summary["final_eval_loss"] == pytest.approx(fits[0].summary["final_eval_loss"], rel=1e-4)
    assert fits[1].bytes_sent == fits[0].bytes_sent and len(fits[1].exchanges) == len(fits[0].exchanges)
    probe = mx.array(x[1000:1010])
    np.testing.assert_allclose(np.array(fits[1].model(probe)), np.array(fits[0].model(probe)), rtol=1e-3, atol=1e-4)
    said.clear()
    for _ in range(2):
        Trainer(MLP(), loss_fn, (x, y), eval_sequences=32, log=said.append).fit(DiLoCo(sync_every=5), workers=2,
                                                                              steps=5, processes=2)
    assert sum("training in one process: the model is an object" in m for m in said) == 2  # asked for: each time


def test_a_trainer_takes_any_config_key_and_names_a_wrong_one(tmp_path):
    """Issue 21: the Trainer's settings are the config's keys (precision, seq_len, ... too), sim's
    defaults for the rest; a wrong name or type is one line."""
    x, y = blobs(200)
    result = Trainer(MLP(), loss_fn, (x, y), lr=1e-2, warmup=2, eval_sequences=32, precision="bf16",
                     moments_precision="bf16", run_dir=tmp_path / "r", log=lambda m: None).fit(
        DiLoCo(sync_every=2), workers=2, steps=4)
    assert {v.dtype for _, v in tree_flatten(result.model.parameters())} == {mx.bfloat16}
    for settings, message in [(dict(warmpu=5), "unknown Trainer setting 'warmpu'; did you mean 'warmup'?"),
                              (dict(workers="4"), 'workers must be a whole number, not "4"'),
                              (dict(strategy="ddp"), "'strategy' is not a Trainer setting; pass it as fit's strategy")]:
        with pytest.raises(ConfigError) as e:
            Trainer(MLP(), loss_fn, (x, y), **settings)
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("objective", ["dpo", "orpo", "grpo"])
def test_a_post_training_objective_on_arrays_or_with_a_loss_fn_is_one_line(tmp_path, objective):
    """Issue 43: on a plain nn.Module with arrays, dpo raised an internal TypeError and left a run
    folder; a loss_fn given with it was ignored (sim refuses --loss with dpo)."""
    x, y = blobs(200)
    for loss, said in ((None, f"objective {objective} reads its "
                               f"{'prompts' if objective == 'grpo' else 'preference pairs'} from JSONL through the "
                               "model's tokenizer: give train_data as a .jsonl file or folder and the model as a "
                               "model folder (docs/post-training.md); arrays and batches train objective sft"),
                       (loss_fn, f"loss_fn is the sft objective's; objective {objective} has its own loss: pass "
                                 "loss_fn=None")):
        with pytest.raises(ConfigError) as e:
            Trainer(MLP(), loss, (x, y), objective=objective, run_dir=tmp_path / "r").fit("diloco", workers=2, steps=2)
        assert str(e.value) == said
        with pytest.raises(ConfigError, match="^loss_fn is the sft objective's") if loss else nullcontext():
            Trainer("MODEL_FOLDER", loss, "pairs/", objective=objective)  # data by path: the loss is refused too
    assert not (tmp_path / "r").exists()


def test_fit_passes_callbacks_to_the_run(tmp_path):
    from mlx_diloco.training.callbacks import TrainingCallback

    class Heard(TrainingCallback):
        def __init__(self):
            self.train, self.val = [], []

        def on_train_loss_report(self, info):
            self.train.append(info["step"])

        def on_val_loss_report(self, info):
            self.val.append(info["step"])

    x, y = blobs(200)
    heard = Heard()
    result = Trainer(MLP(), loss_fn, (x, y), warmup=2, eval_sequences=32, run_dir=tmp_path / "r", log=lambda m: None).fit(
        DiLoCo(sync_every=2), workers=2, steps=4, callbacks=[heard])
    assert heard.train == [1, 2, 3, 4] and heard.val == [r["step"] for r in result.metrics] == [0, 2, 4]
