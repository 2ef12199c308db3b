"""The strategy zoo (issue 10): every strategy trains, counts the bytes it sends, and reduces to
the strategies it generalizes; options are typed and misspellings are named."""

import json
import math

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_config
from mlx_diloco.exchange.codecs import get_codec
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.config import ConfigError
from mlx_diloco.strategies import STRATEGIES, DiLoCo
from mlx_diloco.training.resolve import resolve
from mlx_diloco.training.run import Run

QUIET = dict(log=lambda m: None)


def flat(tree):
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def make_run(tmp_path, name, **overrides):
    config = tiny_config(**overrides)
    return Run(config, tmp_path / name, SimCommunicator(config.workers), **QUIET)


def check(M):  # before every exchange the workers all-gather three float32 each (largest value, non-finite
    return (M - 1) * 12  # count, arrival time)


def ring(M, payload):  # bytes one worker sends in a ring all-reduce of `payload` bytes, after the check
    return 2 * (M - 1) * payload // M + check(M)


def expected_bytes(name, run) -> int:
    """What each strategy sends, from its definition (not from the accounting under test)."""
    M, steps, n, s = run.config.workers, run.config.steps, run.n_params, run.strategy
    if name == "ddp":
        return steps * ring(M, n * 2)
    if name in ("diloco", "fedavg", "muloco"):
        return math.ceil(steps / s.sync_every) * ring(M, n * 2)
    if name == "quorum":  # equal speeds: every worker reports at once, DiLoCo's outer steps (test_quorum.py)
        return math.ceil(steps / s.sync_every) * ring(M, n * 2)
    if name == "sparta":
        return sum(ring(M, len(s.indices(n, t)) * 4) for t in range(1, steps + 1))
    if name == "sparta-diloco":
        sparta = sum(ring(M, len(s.sparta.indices(n, t)) * 4) for t in range(1, steps + 1))
        return sparta + math.ceil(steps / s.sync_every) * ring(M, n * 2)
    if name == "demo":  # per tensor, k coefficients of each DCT block (test_demo.py)
        from test_demo import reference_bytes
        return steps * ((M - 1) * sum(reference_bytes(p.shape[1:]) for _, p in tree_flatten(run.workers.params))
                        + check(M))
    if name == "desloc":  # fp32 averages: parameters every Kx steps and at the end, moments every Ku, Kv
        Ku, Kv = s.period("m"), s.period("v")
        return (math.ceil(steps / s.sync_every) + steps // Ku + steps // Kv) * ring(M, n * 4)
    if name == "sparseloco":  # an all-gather of each tensor's top-k per chunk, 2-bit values (test_sparseloco.py)
        from test_sparseloco import reference_bytes
        payload = sum(reference_bytes(p.shape[1:], s.topk, s.chunk) for _, p in tree_flatten(run.workers.params))
        return math.ceil(steps / s.sync_every) * ((M - 1) * payload + check(M))
    if name == "noloco":  # every H steps each paired worker sends its fp32 weights to its partner, once
        return steps // s.sync_every * (n * 4 + check(M))
    raise AssertionError(name)


OPTIONS = {"sparta": dict(fraction=0.05), "sparta-diloco": dict(fraction=0.05)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_trains_and_counts_its_bytes(tmp_path, name):
    run = make_run(tmp_path, name, strategy=name, steps=24, workers=3, eval_every=8, **OPTIONS.get(name, {}))
    run.train()
    rows = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.05, [r["eval_loss"] for r in rows]
    assert run.ledger.bytes_sent == expected_bytes(name, run)


def test_ddp_equals_one_worker_with_an_n_times_batch(tmp_path):
    ddp = make_run(tmp_path, "ddp", strategy="ddp", workers=3, compress="fp32")
    one = make_run(tmp_path, "one", strategy="ddp", workers=1, compress="fp32")
    for _ in range(4):
        x, y = ddp.next_batch()
        ddp.step((x, y))
        one.step((x.reshape(1, -1, x.shape[-1]), y.reshape(1, -1, y.shape[-1])))  # the 3 workers' batches as one
    a, b = flat(ddp.workers.params), flat(one.workers.params)
    for k in a:
        for w in range(3):
            np.testing.assert_allclose(a[k][w], b[k][0], rtol=1e-4, atol=1e-6, err_msg=k)


def with_sgd(run):
    run.workers.optimizer = optim.SGD(learning_rate=0.5)
    run.workers.optimizer.init(run.workers.params)
    return run


def train_steps(run, steps):
    for _ in range(steps):
        run.step()
    return flat(run.strategy.global_params(run.workers.params))


def test_sparta_with_p_1_is_ddp_with_sgd(tmp_path):
    sparta = with_sgd(make_run(tmp_path, "s", strategy="sparta", fraction=1.0, grad_clip=0))
    ddp = with_sgd(make_run(tmp_path, "d", strategy="ddp", compress="fp32", grad_clip=0))
    a, b = train_steps(sparta, 5), train_steps(ddp, 5)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("p", [0.005, 0.1, 0.5, 0.9])
def test_sparta_averages_exactly_a_fraction_p_of_the_parameters(p):
    from mlx_diloco.strategies.sparta import SPARTA
    n = 10_000
    for step in (1, 2, 3):
        idx = np.array(SPARTA(fraction=p).indices(n, step))
        assert len(np.unique(idx)) == len(idx) == round(p * n)  # drawn without replacement
        assert idx.min() >= 0 and idx.max() < n
    assert not np.array_equal(SPARTA(fraction=0.1).indices(n, 1), SPARTA(fraction=0.1).indices(n, 2))


@pytest.mark.parametrize("off", ["sparta", "diloco"])
def test_hybrid_reduces_to_each_parent(tmp_path, off):
    if off == "sparta":   # no sparse averaging: DiLoCo
        hybrid = make_run(tmp_path, "h", strategy="sparta-diloco", fraction=0.0, compress="fp32")
        parent = make_run(tmp_path, "p", strategy="diloco", compress="fp32")
    else:                 # no outer steps: SPARTA
        hybrid = make_run(tmp_path, "h", strategy="sparta-diloco", fraction=0.1, sync_every=0)
        parent = make_run(tmp_path, "p", strategy="sparta", fraction=0.1)
    a, b = train_steps(hybrid, 9), train_steps(parent, 9)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_ddp_warm_start_then_diloco(tmp_path):
    run = make_run(tmp_path, "r", steps=16, ddp_warmup_steps=6, compress="fp32")
    for _ in range(6):
        run.step()
        for k, p in flat(run.workers.params).items():  # data parallel: replicas stay equal
            np.testing.assert_allclose(p[1], p[0], atol=1e-6, err_msg=k)
    np.testing.assert_allclose(flat(run.strategy.global_params(None))["wte.weight"],
                               flat(run.workers.params)["wte.weight"][0], atol=1e-6)
    run.train()  # then outer steps at 6 + 4, 6 + 8, and the final one
    assert run.ledger.bytes_sent == 6 * ring(2, run.n_params * 4) + 3 * ring(2, run.n_params * 4)


def test_muloco_orthogonalizes_each_replica_on_its_own():
    from mlx_diloco.strategies.muloco import ReplicaMuon
    g = mx.random.normal((3, 16, 8), key=mx.random.key(0))
    X = ReplicaMuon(0.1)._zeropower_via_newtonschulz5(g, 5)
    for w in range(3):  # each replica's matrix is near-orthogonal (Newton-Schulz leaves ~0.7-1.2 singular values)
        s = np.linalg.svd(np.array(X[w]), compute_uv=False)
        assert 0.5 < s.min() and s.max() < 1.3, s


def test_options_are_typed_and_misspellings_named():
    assert DiLoCo(sync_every=100, outer_lr=0.5).options()["sync_every"] == 100
    with pytest.raises(ConfigError, match="has no option 'sync_evry'; did you mean 'sync_every'"):
        DiLoCo(sync_evry=100)
    with pytest.raises(ConfigError, match="sync-every must be a whole number"):
        DiLoCo(sync_every="100")
    with pytest.raises(ConfigError, match="outer-momentum must be in"):
        DiLoCo(outer_momentum=1.5)
    with pytest.raises(ConfigError, match="'fraction' is an option of sparta"):
        resolve(tiny_config(strategy="diloco", fraction=0.1))
    get_codec("int4")
