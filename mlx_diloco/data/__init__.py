"""Training data: corpora, tokenizers, token caches, shards and samplers (datasets.py); the embedded
Shakespeare corpus lives beside it."""
