"""Memory (issue 11): bf16 training, activation checkpointing, the outer state offloaded, peak memory
measured and estimated, and a cluster that refuses what will not fit."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import run_cli, tiny_config
from mlx_diloco.cluster.emulated import SECRET, EmulatedCluster, can_build
from mlx_diloco.config import TrainConfig
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.exchange.worker_axis import stack_copies
from mlx_diloco.machine.memory import GB, MemoryOptions, estimate, make_it_fit, model_shape
from mlx_diloco.models.zoo import ModelSpec, build_model, load_spec
from mlx_diloco.strategies.diloco import DiLoCo
from mlx_diloco.training import checkpoint
from mlx_diloco.training.run import Run, memory_limit


def train(tmp_path, name, **overrides):
    run = Run(tiny_config(**overrides), tmp_path / name, SimCommunicator(2), log=lambda m: None)
    return run, run.train()


def test_bf16_keeps_weights_and_gradients_in_bf16_and_moments_as_asked(tmp_path):
    fp32_run, fp32 = train(tmp_path, "fp32")
    run, bf16 = train(tmp_path, "bf16", precision="bf16")
    assert {v.dtype for _, v in tree_flatten(run.workers.params)} == {mx.bfloat16}
    assert {v.dtype for _, v in tree_flatten(run.workers.optimizer.state) if v.ndim > 1} == {mx.float32}
    assert bf16["final_eval_loss"] == pytest.approx(fp32["final_eval_loss"], rel=0.01)
    lean, _ = train(tmp_path, "lean", precision="bf16", moments_precision="bf16")
    assert {v.dtype for _, v in tree_flatten(lean.workers.optimizer.state) if v.ndim > 1} == {mx.bfloat16}
    # the checkpoint holds what was trained, in its dtype, and resumes
    state, _ = checkpoint.load(tmp_path / "bf16")
    assert {v.dtype for _, v in tree_flatten(state["workers"]["params"])} == {mx.bfloat16}


def test_checkpointing_and_offloading_change_memory_not_results(tmp_path):
    _, plain = train(tmp_path, "plain", steps=8)
    _, ckpt = train(tmp_path, "ckpt", steps=8, grad_checkpoint=True)
    assert ckpt["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=1e-5)
    streaming = dict(steps=12, fragments=2, overlap_steps=1, compress="int4", error_feedback=True)
    ref, ref_summary = train(tmp_path, "in-memory", **streaming)
    run, summary = train(tmp_path, "offloaded", offload_outer=True, **streaming)
    assert summary["final_eval_loss"] == ref_summary["final_eval_loss"]
    assert all(f.store.file and os.path.exists(f.store.file) for f in run.strategy.model_fragments)
    assert "p" not in run.strategy.model_fragments[0].outer.state  # the momentum lives in the file between syncs
    # interrupted with an exchange in flight and resumed: the same end as the straight run
    part = Run(tiny_config(offload_outer=True, **streaming), tmp_path / "cut", SimCommunicator(2), log=lambda m: None)
    part.train(stop_after=9)
    resumed = Run(None, tmp_path / "cut", SimCommunicator(2), resume=True, log=lambda m: None).train()
    assert resumed["final_eval_loss"] == pytest.approx(ref_summary["final_eval_loss"], rel=1e-5)


def test_peak_memory_is_measured_and_bf16_checkpointing_lowers_it(tmp_path):
    peaks = {}
    for name, flags in {"fp32": [], "lean": ["--precision", "bf16", "--grad-checkpoint", "--offload-outer"]}.items():
        out = run_cli("sim", "--model", "small", "--workers", "1", "--processes", "1", "--steps", "2",
                      "--sync-every", "1", "--eval-sequences", "16", "--sample-tokens", "0", *flags,
                      "--run-dir", tmp_path / name)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "peak memory" in out.stdout
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        peaks[name] = json.loads((tmp_path / name / "summary.json").read_text())["peak_memory_bytes"]
        assert 0 < rows[-1]["peak_memory_bytes"] <= peaks[name]  # the summary's counts the last global eval too
    assert peaks["lean"] < 0.75 * peaks["fp32"], peaks


def test_estimates_shrink_with_each_option_and_name_what_fits():
    shape = model_shape({"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                         "num_attention_heads": 32, "vocab_size": 32000}, 1_100_000_000)
    o = MemoryOptions.of(TrainConfig(batch_size=4, seq_len=512), DiLoCo())
    totals = [estimate(shape, o)["total"]]
    for change in (dict(precision="bf16"), dict(offload_outer=True, fragments=11), dict(grad_checkpoint=True),
                   dict(moments_precision="bf16")):
        o = MemoryOptions(**{**o.__dict__, **change})
        totals.append(estimate(shape, o)["total"])
    assert all(a > b for a, b in zip(totals, totals[1:])) and totals[-1] < 12 * GB, totals
    assert make_it_fit(shape, MemoryOptions.of(TrainConfig(batch_size=4, seq_len=512), DiLoCo()), 1 * GB) is None
    out = run_cli("plan", "--model", "llama-1b", "--batch-size", "4", "--seq-len", "512", "--link", "1gbe")
    assert out.returncode == 0 and "memory of one DiLoCo worker" in out.stdout and "to fit a 16 GB Mac" in out.stdout


@pytest.mark.skipif(bool(can_build()), reason=can_build())
def test_launch_refuses_a_job_too_large_for_a_host_before_it_starts(tmp_path):
    cluster = EmulatedCluster(2, tmp_path / "cluster", max_memory={2: 0.012})  # host2 offers 12 MB
    try:
        config = tiny_config(workers=2, batch_size=16, seq_len=32)
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in config.to_dict().items() if not isinstance(v, bool)]
        out = subprocess.run([sys.executable, "-m", "mlx_diloco", "launch", *flags, "--hosts", cluster.hosts_flag,
                              "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MLX_DILOCO_SECRET": SECRET})
        assert out.returncode == 2, out.stderr[-2000:]
        line = out.stderr.strip().splitlines()[-1]
        assert "host2 offers 12 MB for training" in line and "--precision bf16" in line, line
        assert not any((tmp_path / "cluster").glob("host*/jobs/*"))  # nothing started
    finally:
        cluster.close()


LIMITS_SEEN = []


def loss_seeing_the_limit(model, x, y):
    """Cross-entropy, noting MLX's memory limit as training sees it."""
    LIMITS_SEEN.append(mx.get_memory_limit())
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def test_a_memory_limit_lowers_the_peak_and_is_given_back(tmp_path):
    """MLX's CPU allocates each output when it queues the operation: a forward pass through 20
    layers holds all 20 outputs at once. Under a limit MLX waits for queued work instead. A run
    with --memory-limit trains under it, and gives MLX's limit back at the end."""
    weights = [mx.random.normal((512, 512)) / 23 for _ in range(20)]
    x = mx.random.normal((512, 512))
    mx.eval(weights, x)

    def forward_peak():
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        y = x
        for w in weights:
            y = mx.tanh(y @ w)
        mx.eval(y)
        return mx.get_peak_memory() - base
    unlimited = forward_peak()
    with memory_limit((mx.get_active_memory() + 3e6) / 1e9):
        limited = forward_peak()
    assert limited < 0.5 * unlimited

    before = mx.get_memory_limit()
    config = tiny_config(memory_limit=1.5, loss="test_memory:loss_seeing_the_limit")
    Run(config, tmp_path / "r", SimCommunicator(2), log=lambda m: None).train()
    assert set(LIMITS_SEEN) == {1_500_000_000} and mx.get_memory_limit() == before


def squared_error(model, x, y):
    return mx.mean(mx.square(model(x).astype(mx.float32) - y))


def test_the_inner_update_runs_a_group_at_a_time_with_the_same_result():
    """Evaluated at once, an update holds every parameter's old and new weights and moments and
    its temporaries together, well above the backward pass's peak; a group at a time, one
    group's. Same numbers either way (bf16: the stochastic rounding draws the same noise),
    clipping included."""
    from mlx_diloco.strategies.base import Strategy, default_inner_optimizer
    from mlx_diloco.training.workers import Workers
    config = tiny_config(grad_clip=0.01)
    x, y = mx.random.normal((2, 16, 1024)), mx.random.normal((2, 16, 1024))

    def above(fn):
        """Peak memory while `fn` runs, above what was in use before."""
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        fn()
        return mx.get_peak_memory() - base
    runs = {}
    for group in (1 << 30, 1 << 20):  # everything together; each 1024 x 1024 layer (x 2 replicas) alone
        mx.random.seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
        model.set_dtype(mx.bfloat16)
        workers = Workers(model, 2, config, default_inner_optimizer(config), loss=squared_error)
        workers.update_group, workers.whole_step = group, group >= workers.n_elements
        workers.step(x, y, Strategy(), 1)  # creates the moments
        backward = above(lambda: workers._gradients(x, y))
        step = above(lambda: workers.step(x, y, Strategy(), 2))
        runs[group] = step / backward, tree_flatten((workers.params, workers.optimizer.state))
    (whole, reference), (grouped, result) = runs.values()
    assert all(k == l and mx.array_equal(a, b).item() for (k, a), (l, b) in zip(reference, result))
    assert whole > 1.5 and grouped < 1.1


@pytest.mark.parametrize("limit_gb, whole", [(20, True), (0.15, False)])
def test_the_whole_step_is_compiled_where_it_fits_in_memory(limit_gb, whole):
    """The first step measures the backward pass's peak; the whole step runs from then on when that
    peak and a second copy of the parameters and moments fit in MLX's memory limit (8 layers of
    1024 x 1024 in bf16, 2 replicas: 16.8M parameters, 168 MB of parameters and fp32 moments);
    else the update goes a group at a time, with the same numbers."""
    from mlx_diloco.strategies.base import Strategy, default_inner_optimizer
    from mlx_diloco.training.workers import Workers
    config = tiny_config()
    x, y = mx.random.normal((2, 16, 1024)), mx.random.normal((2, 16, 1024))
    mx.random.seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    model.set_dtype(mx.bfloat16)
    workers = Workers(model, 2, config, default_inner_optimizer(config), loss=squared_error)
    with memory_limit(limit_gb):
        for step in (1, 2):
            workers.step(x, y, Strategy(), step)
    assert workers.whole_step is whole
    assert ("compiled whole step" in workers.describe()) is whole


def test_the_offloaded_global_model_is_built_one_fragments_values_at_a_time():
    """Each offloaded fragment's fp32 values are read from their file when their turn comes and
    dropped after: the global model costs its own size and one fragment's values, not all of them."""
    spec = ModelSpec("deep", {"type": "llama", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 704,
                              "num_hidden_layers": 8, "num_attention_heads": 4, "rms_norm_eps": 1e-5})
    model = build_model(spec)
    model.set_dtype(mx.bfloat16)  # a bf16 model keeps fp32 global values
    params = model.trainable_parameters()
    strategy = DiLoCo(fragments=8, offload_outer=True).for_job(1, 10).bind(SimCommunicator(1), steps=10)
    strategy.setup(params)
    fp32 = 4 * sum(v.size for _, v in tree_flatten(params))
    del model, params
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    global_model = strategy.global_params(None)
    mx.eval(global_model)
    assert mx.get_peak_memory() - base < fp32 / 2 + 3 * fp32 / 8, (mx.get_peak_memory() - base, fp32)
    kept = mx.get_active_memory() - base - sum(v.nbytes for _, v in tree_flatten(global_model))
    assert kept < 64_000, kept  # nothing else (the placeholders' zeros evaluated would be 262 KB)


def test_a_sync_handed_the_parameters_frees_each_old_value_as_its_new_one_lands():
    """Run hands the outer step its parameters (Workers.take_params): with no reference left
    elsewhere, a sync holds one model's values, not the old and the new one together."""
    model = build_model(load_spec("small"))
    model.set_dtype(mx.bfloat16)
    strategy = DiLoCo(sync_every=1, fragments=5).for_job(1, 10).bind(SimCommunicator(1), steps=10)
    strategy.setup(model.trainable_parameters())

    def stacked():  # the workers' own copy (stack_copies alone would be a view of the model's arrays)
        params = tree_map(lambda v: v * 1, stack_copies(model.trainable_parameters(), 1))
        mx.eval(params)
        return params

    def peak(step, hand_over):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        held = None if hand_over else stacked()
        mx.eval(strategy.after_step(stacked() if hand_over else held, step))
        return mx.get_peak_memory() - base
    W = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    peak(1, hand_over=True)  # the first outer step creates the outer momentum
    held, handed = peak(2, hand_over=False), peak(3, hand_over=True)
    assert handed < held - 0.8 * W, (held, handed, W)


def test_offload_folders_of_processes_killed_outright_are_removed(tmp_path, monkeypatch):
    """An agent kills a stalled worker with SIGKILL, which leaves its offloaded outer state behind
    (8.8 GB for llama-1b): the next offloading process removes the folders of dead processes."""
    import tempfile
    from mlx_diloco.strategies.fragments import offload_folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"mlx-diloco-outer-{dead.pid}-abc").mkdir()
    (tmp_path / f"mlx-diloco-outer-{os.getpid()}-def").mkdir()  # a live process's
    mine = offload_folder()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"mlx-diloco-outer-{os.getpid()}-def",
                                                                  os.path.basename(mine.name)])


def test_plan_of_adapters_exchanges_the_adapters_and_names_their_share_of_the_model(capsys):
    """With adapters only what trains is exchanged: plan's bytes per sync are the adapters' count
    times the codec's bytes (fp16: 2), beside the full model's; its sync times are theirs."""
    from mlx_diloco.exchange.codecs import get_codec
    from mlx_diloco.exchange.comm import exchange_plan
    from mlx_diloco.machine.memory import trained_shape
    from mlx_diloco.tools.plan import print_plan
    from mlx_diloco.training.metrics import human_bytes
    _, shape = trained_shape(TrainConfig(model="llama-1b", fine_tune_type="lora"))
    print_plan({"fine_tune_type": "lora", "seq_len": 512, "batch_size": 4}, model="llama-1b", links=["1gbe"])
    out = capsys.readouterr().out
    adapters, full = (exchange_plan(get_codec("fp16"), n, 2)[2] for n in (shape.trainable, shape.parameters))
    assert adapters == 2 * shape.trainable and full == 2 * shape.parameters
    assert f"{human_bytes(adapters)} per sync, {adapters / full:.2%} of the full model's {human_bytes(full)}" in out, out
    assert "79 ms" in next(line for line in out.splitlines() if line.startswith("1 GbE"))  # 9.18 MB, not 2.2 GB's 18.7 s


def layout(model: nn.Module) -> dict:
    """Each leaf module's class, and its arrays' shapes and dtypes."""
    return {path: (type(m).__name__, [(k, v.shape, v.dtype) for k, v in tree_flatten(m.parameters())])
            for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)}


def test_a_quantized_preset_is_built_as_mlx_lm_loads_a_quantized_folder_and_trains_adapters_only(tmp_path):
    """"quantization" in a preset, as in an mlx-lm folder's config.json: the model build_model
    makes is the one mlx-lm's load_model makes of that folder. Its memory counts the unpacked
    parameters, the packed base (4 bits and an fp32 scale and bias per 64 values) and the adapters;
    full fine-tuning is refused, and a malformed quantization is one line."""
    from mlx_lm.utils import load_model, save_config, save_model
    from mlx_diloco.machine.memory import trained_shape
    from mlx_diloco.options import ConfigError
    tiny = {**load_spec("llama-tiny").params, "quantization": {"group_size": 32, "bits": 4}}
    (tmp_path / "tiny-4bit.json").write_text(json.dumps(tiny))
    ours = build_model(load_spec(str(tmp_path / "tiny-4bit.json")))
    save_model(tmp_path / "folder", ours)
    save_config({**tiny, "model_type": "llama"}, tmp_path / "folder" / "config.json")
    theirs, _ = load_model(tmp_path / "folder")
    assert layout(ours) == layout(theirs)
    assert {kind for kind, _ in layout(ours).values()} == {"QuantizedEmbedding", "QuantizedLinear", "RMSNorm", "RoPE"}

    _, lora = trained_shape(TrainConfig(model="llama-1b", fine_tune_type="lora"))
    _, qlora = trained_shape(TrainConfig(model="llama-1b-4bit", fine_tune_type="lora"))
    norms = 2048 * (2 * 22 + 1)
    assert qlora.parameters == lora.parameters and qlora.trainable == lora.trainable
    assert qlora.frozen_bytes["fp32"] == (qlora.parameters - norms) * (4 / 8 + 2 * 4 / 64) + norms * 4
    with pytest.raises(ConfigError, match="quantized model trains adapters only"):
        trained_shape(TrainConfig(model="llama-1b-4bit"))
    (tmp_path / "bad.json").write_text(json.dumps({**tiny, "quantization": {"bits": 4}}))
    with pytest.raises(ConfigError, match=r"quantization must be as mlx-lm's config.json has it, e.g. \{\"group_size\""):
        load_spec(str(tmp_path / "bad.json"))


def test_post_training_adds_its_reference_its_pairs_and_its_rollouts():
    """plan's memory of DPO and GRPO (issue 46): a pair is two sequences; DPO and GRPO keep the
    starting policy (a copy of what trains: the whole model under full fine-tuning, the adapters
    under LoRA); GRPO's rollouts hold a group of sequences' keys and values between steps."""
    from mlx_diloco.machine.memory import estimate, trained_shape
    from mlx_diloco.strategies import DiLoCo

    def parts(**keys):
        config = TrainConfig(model="llama-tiny", batch_size=4, seq_len=64, **keys)
        return estimate(trained_shape(config)[1], MemoryOptions.of(config, DiLoCo()))
    sft, dpo, orpo = parts(), parts(objective="dpo"), parts(objective="orpo")
    assert dpo["activations"] == 2 * sft["activations"] == orpo["activations"]
    assert sft["reference"] == orpo["reference"] == 0 and dpo["reference"] == sft["weights"]  # fp32: 4 bytes a value
    lora = parts(objective="dpo", fine_tune_type="lora")
    assert 0 < lora["reference"] == lora["gradients"] < dpo["reference"] / 2
    grpo8, grpo16 = parts(objective="grpo", group_size=8), parts(objective="grpo", group_size=16)
    assert grpo8["rollouts"] > 0 == sft["rollouts"] and grpo16["rollouts"] == pytest.approx(2 * grpo8["rollouts"], rel=1e-6)
    assert grpo16["total"] > grpo8["total"] > sft["total"]


def test_plan_says_what_the_moments_precision_costs_either_way(capsys):
    """A bf16 model's AdamW moments are fp32 by default; plan names their memory and the other
    choice's, bf16 as plain MLX keeps them (--moments-precision bf16), with its total (issue 47)."""
    from mlx_diloco.machine.memory import trained_shape
    from mlx_diloco.tools.plan import print_plan
    n = trained_shape(TrainConfig(model="gpt2-124m"))[1].parameters
    for given, chosen, other in (({}, 8, 4), ({"moments_precision": "bf16"}, 4, 8)):
        print_plan({"precision": "bf16", "batch_size": 4, "seq_len": 256, **given}, model="gpt2-124m", links=["1gbe"])
        line = next(l for l in capsys.readouterr().out.splitlines() if "AdamW moments" in l)
        assert f"{chosen * n / GB:.2f} GB; " in line and f"{other * n / GB:.2f} GB, total" in line, line
        assert "bf16 (--moments-precision bf16, as plain MLX keeps a bf16 model's)" in line, line
