"""Checkpointed blocks and passes that go one block at a time (models/checkpointing.py): the same
numbers as MLX's own autodiff, in a fraction of the memory MLX's CPU would otherwise allocate ahead."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_diloco.exchange.worker_axis import replica
from mlx_diloco.models.checkpointing import block_by_block, blockwise_value_and_grad, checkpoint_blocks
from mlx_diloco.models.precision import to_bf16
from mlx_diloco.models.zoo import ModelSpec, build_model, load_spec
from mlx_diloco.training.workers import cross_entropy


def value_and_grad(model):
    """MLX's own: the reference."""
    def loss(params, x, y):
        model.update(params)
        return cross_entropy(model, x, y)
    return mx.value_and_grad(loss)


def assert_same(a, b):
    a, b = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k


def batch(vocab, shape=(4, 16)):
    return mx.random.randint(0, vocab, shape), mx.random.randint(0, vocab, shape)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])  # a tied head (our GPT), an untied one (mlx-lm's Llama)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_blockwise_gradients_are_mlx_autodiff_bit_for_bit(name, precision):
    model = build_model(load_spec(name))
    if precision == "bf16":
        to_bf16(model)
    params, (x, y) = model.trainable_parameters(), batch(512)
    loss, grads = value_and_grad(model)(params, x, y)
    assert checkpoint_blocks(model) == 2
    blockwise_loss, blockwise_grads = blockwise_value_and_grad(model, cross_entropy)(params, x, y)
    assert mx.array_equal(loss, blockwise_loss).item()
    assert_same(grads, blockwise_grads)
    with block_by_block():  # a forward pass block by block: the same loss too
        model.update(params)
        assert mx.array_equal(cross_entropy(model, x, y), loss).item()


class Unchained(nn.Module):
    """Blocks that do not form a chain (the second one's input is not the first one's output)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = [nn.Linear(32, 32) for _ in range(2)]
        self.head = nn.Linear(32, 64)

    def __call__(self, x):
        h = self.embed(x)
        h = self.layers[0](h)
        return self.head(self.layers[1](2 * h) + h)


def test_a_model_whose_blocks_are_not_a_chain_gets_the_ordinary_backward():
    model = Unchained()
    mx.eval(model.parameters())
    params, (x, y) = model.trainable_parameters(), batch(64)
    loss, grads = value_and_grad(model)(params, x, y)
    checkpoint_blocks(model)
    blockwise_loss, blockwise_grads = blockwise_value_and_grad(model, cross_entropy)(params, x, y)
    assert mx.array_equal(loss, blockwise_loss).item()
    assert_same(grads, blockwise_grads)


def test_the_blockwise_backward_holds_one_blocks_temporaries_at_a_time():
    """bf16 weights multiplied in fp32: evaluated as one graph, MLX's autodiff allocates several
    blocks' fp32 weight copies and fp32 weight gradients ahead; a block at a time holds one's."""
    spec = ModelSpec("deep", {"type": "llama", "vocab_size": 256, "hidden_size": 512, "intermediate_size": 1408,
                              "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 8,
                              "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    model = to_bf16(build_model(spec))
    checkpoint_blocks(model)
    params, (x, y) = model.trainable_parameters(), batch(256, (2, 32))
    mx.eval(params, x, y)

    def above_gradients(fn):
        """Peak memory while `fn` runs, above what was in use before and the gradients it returns."""
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn(params, x, y))
        return mx.get_peak_memory() - base - sum(v.nbytes for _, v in tree_flatten(params))
    ordinary, blockwise = above_gradients(value_and_grad(model)), above_gradients(blockwise_value_and_grad(model, cross_entropy))
    one_block_fp32 = 4 * sum(v.size for _, v in tree_flatten(params["model"]["layers"][0]))
    assert blockwise < min(0.75 * ordinary, 3 * one_block_fp32), (ordinary, blockwise, one_block_fp32)


def test_one_replica_of_stacked_parameters_is_a_view_not_a_copy():
    stacked = {"w": mx.random.normal((2, 1024, 256))}
    mx.eval(stacked)
    before = mx.get_active_memory()
    one = replica(stacked, 1)
    mx.eval(one)
    assert mx.get_active_memory() == before  # `stacked["w"][1]` would copy 1 MB
    assert mx.array_equal(one["w"], stacked["w"][1]).item()
