"""The vmapped simulator trains N replicas exactly like N separately trained models."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from conftest import tiny_config
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.models.zoo import build_model, load_spec
from mlx_diloco.training.run import Run
from mlx_diloco.strategies.base import default_inner_optimizer


def test_vmapped_workers_match_separate_models(tmp_path):
    config = tiny_config(workers=3, strategy="fedavg", sync_every=1000, steps=1000, grad_clip=0)
    run = Run(config, tmp_path / "r", SimCommunicator(3), log=lambda m: None)
    batches = [run.next_batch() for _ in range(4)]
    for batch in batches:
        run.step(batch)

    # The same 3 replicas, each a plain model with its own AdamW, trained one by one.
    for w in range(3):
        model = build_model(load_spec("tiny"), seed=config.seed)
        opt = default_inner_optimizer(config)
        loss_and_grad = nn.value_and_grad(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"))
        for x, y in batches:
            _, grads = loss_and_grad(model, x[w], y[w])
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
        separate = dict(tree_flatten(model.trainable_parameters()))
        for k, p in tree_flatten(run.workers.params):
            np.testing.assert_allclose(np.array(p[w]), np.array(separate[k]), rtol=1e-4, atol=1e-5, err_msg=k)


def test_sequential_mode_matches_vectorized(tmp_path):
    finals = []
    for vectorize in (True, False):
        config = tiny_config(workers=2, steps=8, vectorize=vectorize)
        run = Run(config, tmp_path / f"v{vectorize}", SimCommunicator(2), log=lambda m: None)
        run.train()
        finals.append(dict(tree_flatten(run.strategy.global_params(None))))
    for k in finals[0]:
        np.testing.assert_allclose(np.array(finals[0][k]), np.array(finals[1][k]), rtol=1e-4, atol=1e-5)


def test_workers_diverge_between_syncs(tmp_path):
    """Each worker reads its own shard, so local models differ until the outer step."""
    config = tiny_config(workers=2, sync_every=100)
    run = Run(config, tmp_path / "r", SimCommunicator(2), log=lambda m: None)
    for _ in range(3):
        run.step()
    w = run.workers.params["wte"]["weight"]
    assert float(mx.abs(w[0] - w[1]).max()) > 1e-4
