"""DES-LOC (strategies/desloc.py) against its definition: a numpy AdamW per worker, and the workers'
parameters, first and second moments averaged every Kx, Ku and Kv steps (the paper's Algorithm 1,
the authors' torchft DESLoc); Local Adam is its equal periods. Its bytes, its stop on a worker's
NaN, and a resumed run."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import assert_same_arrays, resumed_run, tiny_config
from mlx_diloco.config import ConfigError
from mlx_diloco.exchange.comm import NonFiniteValues, SimCommunicator
from mlx_diloco.strategies import DESLOC, make_strategy
from mlx_diloco.strategies.base import lr_schedule
from mlx_diloco.training.run import Run

QUIET = dict(log=lambda m: None)
# Each tensor's gradient scale: the second moments span 1e-16 to 1e8.
SCALES = {"tiny": 1e-8, "small": 1e-3, "unit": 1.0, "huge": 1e4}


def ring(M, payload):  # bytes one worker sends in a ring all-reduce, after the check's all-gather
    return 2 * (M - 1) * payload // M + (M - 1) * 12


def gradients(x: dict, centers: dict, noise: dict) -> dict:
    """Each worker's gradient of its own quadratic, scale * (x - center), plus heavy-tailed noise."""
    return {k: SCALES[k] * (x[k] - centers[k] + noise[k]) for k in x}


def numpy_desloc(x0: dict, centers, noises, lrs, Kx, Ku, Kv, M, b1, b2, wd, eps=1e-8) -> dict:
    """The definition in float64: AdamW as MLX's (bias correction, decoupled weight decay), then
    after step t the workers' mean replaces x when t % Kx == 0 or t is the last step, m when
    t % Ku == 0, v when t % Kv == 0 (0: never)."""
    x = {k: np.repeat(v[None].astype(np.float64), M, 0) for k, v in x0.items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.zeros_like(a) for k, a in x.items()}
    T = len(lrs)
    for t in range(1, T + 1):
        lr = lrs[t - 1]
        g = gradients(x, centers, noises[t - 1])
        for k in x:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            x[k] = x[k] * (1 - lr * wd) - (lr / (1 - b1 ** t)) * m[k] / (np.sqrt(v[k]) / np.sqrt(1 - b2 ** t) + eps)
        for tree, K in ((x, Kx), (m, Ku), (v, Kv)):
            if (K and t % K == 0) or (tree is x and t == T):
                for k in tree:
                    tree[k] = np.repeat(tree[k].mean(0, keepdims=True), M, 0)
    return x, m, v


def problem(M: int, T: int, seed: int = 0):
    """Initial parameters, each worker's centers and T steps of heavy-tailed (Student t, 1.5
    degrees of freedom) noise, for a tree of four tensors."""
    rng = np.random.default_rng(seed)
    shapes = {"tiny": (5,), "small": (3, 4), "unit": (7,), "huge": (2, 3)}
    x0 = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    centers = {k: rng.normal(size=(M, *s)).astype(np.float32) for k, s in shapes.items()}
    noises = [{k: (0.3 * rng.standard_t(1.5, size=(M, *s))).astype(np.float32) for k, s in shapes.items()}
              for _ in range(T)]
    return x0, centers, noises


def drive(strategy, M: int, T: int, seed: int = 0, **config):
    """The strategy's hooks around its own inner optimizer's steps (as training/workers.py makes
    them), on the quadratic problem; the stacked parameters and the optimizer."""
    config = tiny_config(strategy="desloc", workers=M, steps=T, **config)
    x0, centers, noises = problem(M, T, seed)
    strategy.bind(SimCommunicator(M), T)
    strategy.setup({k: mx.array(v) for k, v in x0.items()})
    opt = strategy.inner_optimizer(config)
    params = {k: mx.broadcast_to(mx.array(v)[None], (M, *v.shape)) for k, v in x0.items()}
    opt.init(params)
    schedule = lr_schedule(config)
    lrs = [schedule(t).item() for t in range(T)]  # step t + 1's: AdamW reads it before counting the step
    for t in range(1, T + 1):
        g = gradients({k: np.array(p) for k, p in params.items()}, centers, noises[t - 1])
        params = opt.apply_gradients({k: mx.array(a) for k, a in g.items()}, params)
        mx.eval(params, opt.state)
        params = strategy.after_step(params, t)
    return params, opt, (x0, centers, noises, lrs, config)


def moment(opt, key: str) -> dict:
    return {k: np.array(s[key]) for k, s in opt.state.items() if isinstance(s, dict)}


@pytest.mark.parametrize("M", [2, 3, 8])
@pytest.mark.parametrize("periods", [(4, -1, -1), (3, 5, 7), (5, 5, 5), (4, 0, 0)],
                         ids=["paper ratios", "coprime", "local adam", "moments never"])
def test_matches_the_numpy_definition(M, periods):
    Kx, Ku, Kv = periods
    s = DESLOC(sync_every=Kx, first_moment_sync_every=Ku, second_moment_sync_every=Kv)
    T = 30  # not a multiple of Kx: the last step averages the parameters too
    params, opt, (x0, centers, noises, lrs, c) = drive(s, M, T, weight_decay=0.1, lr=3e-2, warmup=3)
    assert len(set(lrs)) > 3  # warmup then cosine: the reference takes the same values
    x, m, v = numpy_desloc(x0, centers, noises, lrs, Kx, s.period("m"), s.period("v"), M, c.beta1, c.beta2,
                           c.weight_decay)
    for k in x:
        np.testing.assert_allclose(np.array(params[k]), x[k], rtol=2e-5, atol=2e-6, err_msg=k)
        np.testing.assert_allclose(moment(opt, "m")[k], m[k], rtol=1e-4, atol=1e-6 * SCALES[k], err_msg=k)
        np.testing.assert_allclose(moment(opt, "v")[k], v[k], rtol=1e-4, atol=1e-6 * SCALES[k] ** 2, err_msg=k)
        assert np.all(x[k] == x[k][:1])  # synced at the end
    # What was exchanged, in order: the parameters every Kx steps and at the end, then each moment on its period.
    want = []
    for t in range(1, T + 1):
        want += ["parameters"] * (t % Kx == 0 or t == T)
        want += [what for what, K in (("first moment", s.period("m")), ("second moment", s.period("v")))
                 if K and t % K == 0]
    assert [r.tag for r in s.comm.drain_records()] == want


def test_periods_and_labels():
    paper = DESLOC(sync_every=16)
    assert (paper.period("m"), paper.period("v")) == (48, 96)  # Ku = 3 Kx, Kv = 6 Kx
    assert paper.label() == "desloc H=16 Ku=48 Kv=96"
    local_adam = DESLOC(sync_every=8, first_moment_sync_every=8, second_moment_sync_every=8)
    assert local_adam.is_local_adam and local_adam.label() == "local-adam H=8"
    assert DESLOC(sync_every=8, first_moment_sync_every=0, second_moment_sync_every=0,
                  compress="bf16").label() == "desloc H=8 Ku=never Kv=never bf16"
    assert make_strategy("desloc", {"sync_every": 8}).sync_every == 8  # the run's property: evaluations, checkpoints


@pytest.mark.parametrize("bad, why", [(dict(compress="fp16"), "compress must be fp32 or bf16"),
                                      (dict(compress="int4"), "compress must be fp32 or bf16"),
                                      (dict(sync_every=0), "sync-every (Kx) must be >= 1"),
                                      (dict(second_moment_sync_every=-2), "second-moment-sync-every must be")])
def test_bad_options_are_one_line(bad, why):
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
        DESLOC(**bad)


def test_moments_never_averaged_stay_each_workers_own():
    s = DESLOC(sync_every=4, first_moment_sync_every=0, second_moment_sync_every=0)
    params, opt, _ = drive(s, 3, 12)
    for key in ("m", "v"):
        for k, a in moment(opt, key).items():
            assert not np.allclose(a[0], a[1], rtol=1e-3, atol=0), (key, k)
    for k, p in params.items():
        np.testing.assert_array_equal(np.array(p[0]), np.array(p[2]), err_msg=k)
    assert {r.tag for r in s.comm.drain_records()} == {"parameters"}


def desloc_bytes(M, T, n, Kx, Ku, Kv, bytes_per_value=4) -> int:
    """One ring all-reduce of the n values per average: the parameters every Kx steps and at the
    end, each moment every Ku and Kv steps."""
    syncs = math.ceil(T / Kx) + (T // Ku if Ku else 0) + (T // Kv if Kv else 0)
    return syncs * ring(M, n * bytes_per_value)


@pytest.mark.parametrize("M, compress", [(3, "fp32"), (4, "bf16")])
def test_a_run_sends_the_formulas_bytes(tmp_path, M, compress):
    config = tiny_config(strategy="desloc", workers=M, steps=26, sync_every=4, compress=compress)
    run = Run(config, tmp_path / "r", SimCommunicator(M), **QUIET)
    run.train()
    assert run.strategy.label() == "desloc H=4 Ku=12 Kv=24" + (" bf16" if compress == "bf16" else "")
    # 7 parameter averages (4, 8, ..., 24 and the last step, 26), 2 of the first moment, 1 of the second
    assert run.ledger.bytes_sent == desloc_bytes(M, 26, run.n_params, 4, 12, 24, 2 if compress == "bf16" else 4)
    assert run.ledger.bytes_sent == 10 * ring(M, run.n_params * (2 if compress == "bf16" else 4))
    params = tree_flatten(run.workers.params)
    for k, p in params:
        for w in range(1, M):
            np.testing.assert_array_equal(np.array(p[w]), np.array(p[0]), err_msg=k)


@pytest.mark.parametrize("tree", ["parameters", "first moment", "second moment"])
def test_a_nan_from_one_worker_stops_every_worker_naming_it(tree):
    s = DESLOC(sync_every=2, first_moment_sync_every=2, second_moment_sync_every=2)
    s.bind(SimCommunicator(3), 10)
    params = {"w": mx.zeros((3, 4)), "b": mx.ones((3, 2))}
    s.setup(tree_map(lambda p: p[0], params))
    opt = s.inner_optimizer(tiny_config(strategy="desloc", workers=3))
    opt.init(params)
    poisoned = mx.array(np.where(np.arange(3)[:, None] == 1, np.nan, 0.0).astype(np.float32))
    if tree == "parameters":
        params["w"] = params["w"] + poisoned
    else:
        opt.state["w"] = {**opt.state["w"], {"first moment": "m", "second moment": "v"}[tree]: poisoned}
    with pytest.raises(NonFiniteValues, match=f"worker 1 sent non-finite values .* in {tree}") as e:
        s.after_step(params, 2)
    assert e.value.workers == [1]


def test_a_nan_in_the_parameters_stops_the_run_at_an_exchange_of_moments_alone():
    """Kx = 4, Ku = 2: step 2 averages the first moment only. The NaN in worker 1's parameters was
    noticed only at step 4's parameter average; now at step 2's exchange."""
    s = DESLOC(sync_every=4, first_moment_sync_every=2, second_moment_sync_every=0)
    s.bind(SimCommunicator(3), 10)
    params = {"w": mx.zeros((3, 4))}
    s.setup(tree_map(lambda p: p[0], params))
    s.inner_optimizer(tiny_config(strategy="desloc", workers=3)).init(params)
    params["w"] = params["w"] + mx.array(np.where(np.arange(3)[:, None] == 1, np.nan, 0.0).astype(np.float32))
    with pytest.raises(NonFiniteValues, match=r"^worker 1 holds non-finite values \(NaN or inf\) in its parameters$"):
        s.after_step(params, 2)


def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path):
    config = tiny_config(strategy="desloc", workers=3, steps=14, sync_every=2, first_moment_sync_every=4,
                         second_moment_sync_every=6)
    straight = Run(config, tmp_path / "straight", SimCommunicator(3), **QUIET)
    straight.train()
    resumed = resumed_run(config, tmp_path / "split", stop_after=7)  # a checkpoint every Kx = 2 steps: the last at 6
    assert resumed.steps_done == 6
    resumed.train()
    assert_same_arrays({"params": straight.workers.params, "inner": straight.workers.optimizer.state},
                       {"params": resumed.workers.params, "inner": resumed.workers.optimizer.state})
