"""The DiLoCo algebra: Nesterov outer step, FedAvg = mean, H=1 DiLoCo = DDP with SGD."""

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from conftest import tiny_config
from mlx_diloco.config import ConfigError
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.strategies.fragments import Fragment
from mlx_diloco import run_folder
from mlx_diloco.training.run import Run


def flat(tree):
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def assert_trees_close(a, b, **tol):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(fa[k], fb[k], err_msg=k, **tol)


def make_run(tmp_path, name, **overrides):
    config = tiny_config(**overrides)
    return Run(config, tmp_path / name, SimCommunicator(config.workers), log=lambda m: None)


def test_outer_step_is_nesterov_formula(tmp_path):
    """v <- mu v + delta;  theta <- theta - eta (delta + mu v), checked over several outer steps."""
    run = make_run(tmp_path, "r", strategy="diloco", compress="fp32", outer_lr=0.7, outer_momentum=0.9)
    theta = flat(run.strategy.global_params(None))
    v = {k: np.zeros_like(p) for k, p in theta.items()}
    for _ in range(3):
        for _ in range(run.strategy.sync_every - 1):
            run.step()
        tick = run.inner_step()
        local = flat(run.workers.params)
        run.end_step(tick)  # the outer step
        for k in theta:
            delta = (theta[k][None] - local[k]).mean(axis=0)
            v[k] = 0.9 * v[k] + delta
            theta[k] = theta[k] - 0.7 * (delta + 0.9 * v[k])
        got = flat(run.strategy.global_params(None))
        for k in theta:
            np.testing.assert_allclose(got[k], theta[k], rtol=1e-5, atol=1e-6, err_msg=k)
            # every worker restarts from the new global model
            np.testing.assert_allclose(flat(run.workers.params)[k], np.broadcast_to(theta[k], local[k].shape), atol=1e-6)


def test_fedavg_global_is_mean_of_workers(tmp_path):
    run = make_run(tmp_path, "r", strategy="fedavg", compress="fp32", sync_every=3)
    for _ in range(2):
        run.step()
    tick = run.inner_step()
    mean = tree_map(lambda p: p.mean(axis=0), run.workers.params)
    run.end_step(tick)  # the outer step
    assert_trees_close(run.strategy.global_params(None), mean, rtol=1e-5, atol=1e-6)


def test_diloco_h1_fedavg_equals_ddp_with_sgd(tmp_path):
    """With inner SGD, H=1 and outer lr 1 / momentum 0, DiLoCo is exactly data-parallel SGD:
    theta - mean(theta - (theta - lr g_m)) = theta - lr mean(g_m)."""
    results = {}
    for strategy, overrides in {"diloco": dict(sync_every=1, outer_lr=1.0, outer_momentum=0.0),
                                "ddp": {}}.items():
        run = make_run(tmp_path, strategy, strategy=strategy, compress="fp32", grad_clip=0, **overrides)
        run.workers.optimizer = optim.SGD(learning_rate=0.5)
        run.workers.optimizer.init(run.workers.params)
        for _ in range(5):
            run.step()
        results[strategy] = run.strategy.global_params(run.workers.params)
    assert_trees_close(results["diloco"], results["ddp"], rtol=1e-4, atol=1e-6)
    # and training did move the parameters
    start = make_run(tmp_path, "start").strategy.global_params(None)
    assert max(np.abs(a - b).max() for a, b in zip(flat(start).values(), flat(results["ddp"]).values())) > 1e-3


def test_ddp_keeps_replicas_identical(tmp_path):
    run = make_run(tmp_path, "r", strategy="ddp", workers=3, compress="fp32")
    for _ in range(3):
        run.step()
    for k, p in flat(run.workers.params).items():
        np.testing.assert_allclose(p[1], p[0], atol=1e-6, err_msg=k)
        np.testing.assert_allclose(p[2], p[0], atol=1e-6, err_msg=k)


def test_pseudo_gradient_bytes_are_accounted(tmp_path):
    run = make_run(tmp_path, "r", workers=4, sync_every=2, steps=4, compress="fp16")
    run.train()
    # two outer steps, fp16 payload, ring all-reduce sends 2 (M-1)/M of it, after the all-gather of
    # every worker's largest value, non-finite count and arrival time (three float32 each)
    payload = run.n_params * 2
    assert run.ledger.bytes_sent == 2 * (int(2 * 3 / 4 * payload) + 3 * 12)


def test_a_short_last_round_lands_on_the_workers_mean(tmp_path):
    """Issue 20: with steps = 10 and H = 4 the last round has 2 steps; an outer step with the
    momentum of full rounds would carry the global model past the workers, so it becomes their
    mean, and the outer momentum is left as the last full round made it."""
    run = make_run(tmp_path, "r", strategy="diloco", compress="fp32", steps=10, outer_lr=0.7, outer_momentum=0.9)
    fragment = run.strategy.model_fragments[0]
    for _ in range(9):
        run.step()
    tick = run.inner_step()
    local, momentum = flat(run.workers.params), np.array(fragment.store.outer_state["p"]["v"])
    run.end_step(tick)  # the last, short round's outer step
    assert_trees_close(run.strategy.global_params(None), {k: v.mean(axis=0) for k, v in local.items()},
                       rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(fragment.store.outer_state["p"]["v"]), momentum)


def test_each_fragment_knows_the_length_of_its_round():
    f = Fragment(0, [], mx.zeros((4,)), optim.SGD(learning_rate=1.0), sync_every=4, offset=2, delay=0, alpha=0.0,
                 codec=None, error_feedback=False, n_local=1)
    assert [f.round_length(t) for t in range(1, 11)] == [1, 2, 1, 2, 3, 4, 1, 2, 3, 4]  # sends at 2, 6, 10


def test_a_worker_with_nan_stops_the_run_before_the_global_model_and_its_checkpoint(tmp_path):
    run = make_run(tmp_path, "r", workers=3, steps=12)
    run.train(stop_after=4)  # synced and checkpointed at step 4
    before = flat(run.strategy.global_params(None))
    poisoned = [(k, mx.where(mx.arange(3).reshape(3, *[1] * (v.ndim - 1)) == 1, float("nan"), v) if i == 0 else v)
                for i, (k, v) in enumerate(tree_flatten(run.workers.params))]
    run.workers.params = tree_unflatten(poisoned)
    with pytest.raises(ConfigError, match=r"step 8: worker 1 sent non-finite values .* last checkpoint \(step 4\) is intact"):
        run.train()
    assert run_folder.latest_step(tmp_path / "r") == 4
    after = flat(run.strategy.global_params(None))
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.mark.parametrize("eval_every", [0, 6])
def test_a_global_model_whose_eval_loss_is_not_finite_has_diverged(tmp_path, eval_every):
    """Issue 43: an outer lr of 1e9 leaves the global model's weights finite and its loss NaN; the run
    went on and checkpointed it. Now it stops at the evaluation, or (eval-every 6: no evaluation at
    step 8) at the checkpoint, and the last checkpoint is the one before, whose loss is finite."""
    run = make_run(tmp_path, "r", outer_lr=1e9, steps=24, eval_every=eval_every)
    with pytest.raises(ConfigError, match=r"^step 8: the global model's eval loss is not finite: training diverged, "
                                          r"and the run stops before it is checkpointed \(its last checkpoint \(step 4\) "
                                          r"is intact\); lower --lr or --outer-lr"):
        run.train()
    assert run_folder.latest_step(tmp_path / "r") == 4
    resumed = Run(None, tmp_path / "r", SimCommunicator(2), resume=True, log=lambda m: None)
    assert np.isfinite(resumed.workers.eval_params(resumed.global_params(), resumed.eval_batches))


def test_with_one_process_the_nan_error_has_a_line_of_its_own(tmp_path):
    """sim --processes 1 printed the error after the progress bar, on its line (the bar is drawn with \\r)."""
    from conftest import run_cli
    out = run_cli("sim", "--model", "tiny", "--seq-len", 16, "--batch-size", 4, "--workers", 2, "--steps", 40,
                  "--sync-every", 4, "--warmup", 0, "--lr", 1e4, "--processes", 1, "--sample-tokens", 0,
                  "--run-dir", tmp_path / "r")
    assert out.returncode == 2
    (said,) = [line for line in out.stderr.split("\n") if "mlx-diloco: error:" in line]
    assert said.startswith("mlx-diloco: error: step 4: workers 0, 1 sent non-finite values"), repr(said[:300])


def test_nan_in_an_exchange_still_in_flight_never_reaches_a_checkpoint(tmp_path):
    """Streaming DiLoCo with one step of overlap, H = 4: the exchange sent at step 8 lands at step 9,
    after the checkpoint of step 8, which therefore checks the weights it would keep."""
    run = make_run(tmp_path, "r", workers=3, steps=12, overlap_steps=1)
    run.train(stop_after=7)
    run.workers.params = tree_unflatten([(k, mx.where(mx.arange(3).reshape(3, *[1] * (v.ndim - 1)) == 1, float("nan"), v))
                                         for k, v in tree_flatten(run.workers.params)])
    with pytest.raises(ConfigError, match=r"step 8: worker 1 holds non-finite values .* in its weights.*step 4\) is intact"):
        run.train()
    assert run_folder.latest_step(tmp_path / "r") == 4
