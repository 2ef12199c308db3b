import numpy as np
import pytest

from mlx_diloco.config import ConfigError
from mlx_diloco.data.datasets import ShardSampler, Tokenizer, load_text, prepare


def test_embedded_corpus_is_shakespeare():
    text = load_text("shakespeare")
    assert len(text) > 4_000_000 and "ROMEO" in text and "Hamlet" in text


def test_tokenized_cache_and_round_trip(token_cache):
    data = prepare("shakespeare", 16, 512, log=lambda m: None)
    assert data.vocab_size <= 512 and len(data.train) > 10 * len(data.val) > 0
    x, y = data.train.get([0, 5])
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()
    tok = Tokenizer(data.tokenizer_dir)
    assert tok.decode(tok.encode("To be, or not to be")) == "To be, or not to be"
    again = prepare("shakespeare", 16, 512, log=lambda m: pytest.fail("re-tokenized: " + m))
    assert np.array_equal(again.train.get([3])[0], data.train.get([3])[0])


def test_user_text_folder(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    data = prepare(str(tmp_path), 8, 300, log=lambda m: None)
    assert len(data.train) > 0


def test_shards_are_disjoint_and_cover_the_data():
    samplers = [ShardSampler(1000, w, 4, seed=1) for w in range(4)]
    epochs = [set(s.next_indices(250).tolist()) for s in samplers]
    assert sum(len(e) for e in epochs) == 1000 and len(set.union(*epochs)) == 1000


def test_sampler_resumes_from_cursor():
    a = ShardSampler(100, 0, 1, seed=3)
    a.next_indices(70)
    b = ShardSampler(100, 0, 1, seed=3)
    b.load_state(a.state())
    assert np.array_equal(a.next_indices(50), b.next_indices(50))  # crosses an epoch boundary


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"))
