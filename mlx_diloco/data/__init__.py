"""Training data: corpora, tokenizers, token caches, shards and samplers (datasets.py); the embedded
Shakespeare corpus lives beside it."""

# The data sets named, not given as paths (here: what the agent checks imports neither numpy nor MLX).
EMBEDDED = "shakespeare"
FASHION_MNIST = "fashion-mnist"
