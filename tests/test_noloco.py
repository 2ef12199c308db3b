"""NoLoCo (strategies/noloco.py): its outer step against a numpy transcription of the authors' code,
its ring-neighbour pairings, the pair mean's bytes, a NaN stopping the run, and only exact codecs."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import assert_same_arrays, resumed_run, tiny_config
from mlx_diloco.exchange.codecs import CHECK_BYTES, get_codec
from mlx_diloco.exchange.comm import NonFiniteValues, SimCommunicator
from mlx_diloco.options import ConfigError
from mlx_diloco.strategies.noloco import NoLoCo, pairing
from mlx_diloco.training.run import Run


def reference_outer_step(theta, phi, m, partner, outer_lr, momentum):
    """github.com/jkolehm/noloco, src/noloco/sparse_optimizer_c.py, outer_step, in float64, worker
    by worker: the group's mean outer weights and mean (theta - phi), then
    m += (momentum - 1) m + lr mean_g + lr (mean - phi); phi += m; theta = phi."""
    theta, phi, m = (np.asarray(a, np.float64) for a in (theta, phi, m))
    new_phi, new_m = phi.copy(), m.copy()
    for w, p in enumerate(partner):
        group = sorted({w, p})  # a worker that sits out is a group of one
        mean = phi[group].mean(axis=0)
        mean_g = (theta[group] - phi[group]).mean(axis=0)
        new_m[w] = m[w] + (momentum - 1.0) * m[w] + outer_lr * mean_g + outer_lr * (mean - phi[w])
        new_phi[w] = phi[w] + new_m[w]
    return new_phi, new_m


def bound(M, **options):
    return NoLoCo(sync_every=1, **options).bind(SimCommunicator(M), steps=100)


@pytest.mark.parametrize("M", [2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("scale", [1e-8, 1e-3, 1.0, 1e4])
def test_outer_steps_match_the_reference(M, scale):
    """Two outer steps, from one drawn and one given pairing, for pseudo-gradients of every size,
    heavy-tailed (Cauchy), on weights whose pseudo-gradients fp32 can hold; from outer weights and
    momenta that differ by worker (as they do after a few rounds), so the pull toward the pair's
    mean counts from the first step."""
    rng = np.random.default_rng(M)
    L = 2000
    start = rng.normal(size=L).astype(np.float32) * max(scale, 1e-6)  # weights ~ the steps, or 1e-6 at least
    strategy = bound(M, outer_lr=0.7, outer_momentum=0.5)
    strategy.setup({"w": mx.array(start)})
    phi = (start + rng.normal(size=(M, L)) * max(scale, 1e-6)).astype(np.float32)
    m = (rng.normal(size=(M, L)) * scale).astype(np.float32)
    strategy.load_state({"outer": mx.array(phi), "momentum": mx.array(m)})
    # a drawn pairing, then any other (the simulator needs no neighbours): reversed, or for odd M
    given = [pairing(M, seed=0, outer_step=1), list(range(M))[::-1] if M % 2 == 0 else None]
    for step, partner in enumerate(given, start=1):
        if partner is None:  # odd M: worker 0 sits out, the rest pair up as neighbours (1, 2), (3, 4), ...
            partner = [0] + [w + 1 if w % 2 else w - 1 for w in range(1, M)]
        strategy.pairing = lambda outer_step, partner=partner: partner
        delta = (rng.standard_cauchy((M, L)) * scale).astype(np.float32)
        theta = (phi - delta).astype(np.float32)  # the workers' weights after H inner steps
        out = strategy.after_step({"w": mx.array(theta)}, step)
        phi, m = reference_outer_step(theta, phi, m, partner, 0.7, 0.5)
        # fp32 arithmetic on values of these sizes: a few units in the last place of the largest
        size = np.abs(theta).max(axis=0) + np.abs(phi) + np.abs(m)
        for got, want in ((np.array(strategy.outer), phi), (np.array(strategy.momentum), m), (np.array(out["w"]), phi)):
            assert np.all(np.abs(got - want) <= 4e-7 * size), np.abs(got - want).max()
        phi, m = np.array(strategy.outer, np.float64), np.array(strategy.momentum, np.float64)  # go on from fp32


def test_a_pair_ends_with_one_mean_and_a_lone_worker_with_its_own():
    comm = SimCommunicator(3)
    x = mx.random.normal((3, 1000), key=mx.random.key(0))
    for codec in ("fp32", "bf16", "fp16", "int4"):
        out = np.array(comm.start_pair_mean(x, [1, 0, 2], codec).result())
        assert np.array_equal(out[0], out[1]) and np.array_equal(out[2], np.array(x[2]))
        decoded = np.array(get_codec(codec).roundtrip(x[:2], salt=mx.array([0, 1])))
        np.testing.assert_allclose(out[0], decoded.mean(axis=0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "int2", "e3m0", "int4-stochastic"])
def test_a_lossy_codec_is_refused_in_one_line(codec, tmp_path):
    """Each worker sends its weights, so a codec's error is a fraction of the weights, not of the
    outer step (issue 39: on unit-scale weights that moved by 1e-3, the step came out 21% wrong with
    fp16, 746% with int8). Refused before the run folder exists."""
    with pytest.raises(ConfigError, match=f"^noloco: compress {codec} would round the weights themselves.*"
                                          "use --compress fp32, or bf16 with --precision bf16") as refused:
        Run(tiny_config(strategy="noloco", compress=codec), tmp_path / "run", SimCommunicator(2), log=lambda m: None)
    assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()


def test_bf16_sends_bf16_weights_exactly_and_refuses_fp32_ones():
    """bf16 weights (--precision bf16) go through bf16 unchanged: every outer step is the fp32
    exchange's, in half the bytes. fp32 weights would be rounded (on unit-scale weights that moved
    by 1e-3: the step 194% wrong): refused."""
    rng = np.random.default_rng(0)
    start = mx.array(rng.normal(size=1000).astype(np.float32))
    with pytest.raises(ConfigError, match="^noloco: compress bf16 would round fp32 weights.*--precision bf16"):
        bound(4, compress="bf16").setup({"w": start})
    exact, halved = bound(4, compress="fp32"), bound(4, compress="bf16")
    for strategy in (exact, halved):
        strategy.setup({"w": start.astype(mx.bfloat16)})
    for step in (1, 2):
        theta = {"w": (start + mx.array(rng.normal(size=(4, 1000)) * 1e-3)).astype(mx.bfloat16)}
        assert_same_arrays({"w": exact.after_step(theta, step)["w"].astype(mx.float32), "s": exact.state()},
                           {"w": halved.after_step(theta, step)["w"].astype(mx.float32), "s": halved.state()})
    sent = [r.sent_bytes - 3 * CHECK_BYTES for s in (exact, halved) for r in s.comm.drain_records()]
    assert sent == [4000] * 2 + [2000] * 2


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 8, 9])
def test_pairings_are_ring_neighbours_that_vary(M):
    rounds = [pairing(M, seed=3, outer_step=t) for t in range(1, 201)]
    for partner in rounds:
        assert all(partner[p] == w for w, p in enumerate(partner))  # each in one pair at most
        assert all(p == w or (p - w) % M in (1, M - 1) for w, p in enumerate(partner))  # ring neighbours
        assert sum(p == w for w, p in enumerate(partner)) == M % 2  # one sits out when M is odd
    assert rounds == [pairing(M, seed=3, outer_step=t) for t in range(1, 201)]  # every worker draws the same
    distinct = {tuple(p) for p in rounds}
    assert len(distinct) == {1: 1, 2: 1}.get(M, 2 if M % 2 == 0 else M)  # every neighbour pairing occurs
    if M > 2:  # another seed, another sequence
        assert rounds[:20] != [pairing(M, seed=4, outer_step=t) for t in range(1, 21)]


@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp16", "int4"])
def test_pair_mean_bytes(M, codec):
    """One payload for a worker that has a partner (its values with their unit or scales), after the
    check's all-gather; none when all sit out."""
    comm = SimCommunicator(M)
    comm.start_pair_mean(mx.ones((M, 999)), pairing(M, 0, 1), codec).result()
    (record,) = comm.drain_records()
    payload = get_codec(codec).wire_bytes(999)
    assert record.sent_bytes == payload * (M > 1) + (M - 1) * CHECK_BYTES
    assert record.hops == M - 1 + (M > 1)


@pytest.mark.parametrize("bad", [0, 3])
def test_a_non_finite_value_stops_every_worker(bad):
    strategy = bound(4)
    strategy.setup({"w": mx.zeros(10)})
    weights = np.ones((4, 10), np.float32)
    weights[bad, 5] = np.nan
    with pytest.raises(NonFiniteValues, match=f"worker {bad} sent non-finite values") as e:
        strategy.after_step({"w": mx.array(weights)}, 1)
    assert e.value.workers == [bad]


def test_two_workers_are_diloco_with_heavy_ball_momentum(tmp_path):
    """With M = 2 the pair is the job and the workers' outer states stay equal: NoLoCo is DiLoCo with
    the same outer step (heavy-ball SGD, lr 0.7, momentum 0.5) on the workers' mean."""
    runs = {name: Run(tiny_config(strategy=name, steps=8, **options), tmp_path / name, SimCommunicator(2),
                      log=lambda m: None)
            for name, options in [("noloco", {}), ("diloco", dict(outer_optimizer="sgd", outer_lr=0.7,
                                                                  outer_momentum=0.5, compress="fp32"))]}
    params = {}
    for name, run in runs.items():
        run.train()
        params[name] = dict(tree_flatten(run.workers.params))
    for k, v in params["diloco"].items():
        np.testing.assert_allclose(np.array(params["noloco"][k]), np.array(v), rtol=1e-5, atol=1e-6, err_msg=k)


def test_trains_counts_its_bytes_and_resumes_exactly(tmp_path):
    config = tiny_config(strategy="noloco", workers=3, steps=12, eval_every=4)  # H = 4
    straight = Run(config, tmp_path / "straight", SimCommunicator(3), log=lambda m: None)
    straight.train()
    check = 2 * CHECK_BYTES
    assert straight.ledger.bytes_sent == 3 * (straight.n_params * 4 + check)
    rows = [json.loads(l) for l in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.05
    params = {k: np.array(v) for k, v in tree_flatten(straight.workers.params)}
    assert not np.array_equal(params["wte.weight"][0], params["wte.weight"][1])  # no global model: they differ

    resumed = resumed_run(config, tmp_path / "split", stop_after=6)
    assert resumed.steps_done == 4
    resumed.train()
    assert_same_arrays({"w": straight.workers.params, "s": straight.strategy.state()},
                       {"w": resumed.workers.params, "s": resumed.strategy.state()})
