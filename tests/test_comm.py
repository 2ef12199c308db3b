"""The communication interface in the simulator: means, gathers, and the bytes they cost."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_diloco.exchange.codecs import CHECK_BYTES
from mlx_diloco.exchange.comm import SimCommunicator


def test_all_mean_in_fp16_and_ring_byte_count():
    comm = SimCommunicator(4)
    x = {"w": mx.arange(4 * 6, dtype=mx.float32).reshape(4, 6) / 7}
    mean = comm.all_mean(x, "fp16")
    np.testing.assert_allclose(np.array(mean["w"]), np.array(x["w"]).mean(axis=0), rtol=1e-3)
    assert mean["w"].dtype == mx.float32
    (record,) = comm.drain_records()
    # the fp16 values (their unit is shared by the check that comes first, CHECK_BYTES per worker)
    assert record.payload_bytes == 6 * 2 and record.sent_bytes == int(2 * 3 / 4 * 12) + 3 * CHECK_BYTES


def test_async_mean_can_overlap():
    comm = SimCommunicator(2)
    pending = comm.start_all_mean({"w": mx.ones((2, 5))})
    assert np.array_equal(np.array(pending.result()["w"]), np.ones(5))


@pytest.mark.parametrize("codec", ["int4", "e3m0", "int2", "fp16"])
def test_one_worker_exchanges_with_any_codec(codec):
    x = mx.random.normal((1, 1000), key=mx.random.key(0))
    out = SimCommunicator(1).start_mean(x, codec).result()
    assert out.shape == (1000,) and np.isfinite(np.array(out)).all()


def test_the_check_before_an_exchange_holds_no_copy_of_the_values():
    x = mx.random.normal((2, 4_000_000), key=mx.random.key(1))
    mx.eval(x)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(SimCommunicator(2).start_mean(x, "fp32").result())
    # x / M (one buffer) and the sum (half of one); a copy of the values for the check would add a buffer
    assert mx.get_peak_memory() - base <= 1.6 * x.nbytes


def test_exchanges_started_while_held_reach_the_link_when_the_hold_ends():
    """The run holds a tick's new exchanges while its own collectives run (training/run.py): held, an
    exchange has not started (starting one is timed: blocked_s); the hold's end starts them in order,
    with the values an exchange started at once would give; a result asked for inside takes those
    held before it along; after an error nothing held starts, and the hold is over."""
    x = mx.random.normal((3, 1000), key=mx.random.key(2))
    want = np.array(SimCommunicator(3).start_mean(x, "int4").result())
    want_fp16 = np.array(SimCommunicator(3).start_mean(2 * x, "fp16").result())
    comm = SimCommunicator(3)
    with comm.exchanges_held():
        first, second = comm.start_mean(x, "int4"), comm.start_mean(2 * x, "fp16")
        assert first.record.blocked_s == second.record.blocked_s == 0.0
    assert first.record.blocked_s > 0 and second.record.blocked_s > 0
    np.testing.assert_array_equal(np.array(first.result()), want)
    np.testing.assert_array_equal(np.array(second.result()), want_fp16)

    with comm.exchanges_held():
        first, second = comm.start_mean(x, "int4"), comm.start_mean(x, "int4")
        np.testing.assert_array_equal(np.array(second.result()), want)
        assert first.record.blocked_s > 0
        third = comm.start_mean(x, "int4")
        assert third.record.blocked_s == 0.0
    assert third.record.blocked_s > 0

    with pytest.raises(ValueError):
        with comm.exchanges_held():
            dropped = comm.start_mean(x, "int4")
            raise ValueError("a check failed")
    assert dropped.record.blocked_s == 0.0 and comm.start_mean(x, "int4").record.blocked_s > 0
