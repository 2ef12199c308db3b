"""One held-out set for every run (issue 44): an evaluation scores the first --eval-sequences
examples of the held-out split, whatever the batch size, worker count or strategy, so that any two
runs on the same data compare on the same held-out text."""

import pytest

from conftest import tiny_config
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.training.metrics import MetricsLog
from mlx_diloco.training.run import Run


def test_runs_of_any_batch_size_worker_count_and_strategy_score_the_same_held_out_examples(tmp_path):
    before_training = {}
    for strategy, workers, batch in (("ddp", 1, 16), ("ddp", 4, 4), ("diloco", 2, 3)):  # 40 = 13 x 3 + 1
        config = tiny_config(strategy=strategy, workers=workers, batch_size=batch, eval_sequences=40, steps=1)
        summary = Run(config, tmp_path / f"{strategy}{workers}x{batch}", SimCommunicator(workers),
                      log=lambda m: None).train()
        assert summary["eval_examples"] == 40
        first = MetricsLog.read(tmp_path / f"{strategy}{workers}x{batch}")[0]
        assert first["step"] == 0
        before_training[(strategy, workers, batch)] = first["eval_loss"]
    # the same initial model on the same 40 sequences: the same loss, however they were batched
    assert max(before_training.values()) - min(before_training.values()) < 1e-5, before_training


def test_eval_batches_is_read_as_batches_of_the_batch_size():
    # mlx-lm's val_batches, and the config.json of run folders from before eval_sequences
    assert TrainConfig.from_dict({"eval_batches": 3, "batch_size": 5}).eval_sequences == 15
    assert TrainConfig.from_dict({"eval_batches": 3}).eval_sequences == 3 * TrainConfig.batch_size
    with pytest.raises(ConfigError, match="give eval_sequences or eval_batches"):
        TrainConfig.from_dict({"eval_batches": 3, "eval_sequences": 8})
    with pytest.raises(ConfigError, match="eval-sequences must be >= 1"):
        TrainConfig.from_dict({"eval_sequences": 0})
