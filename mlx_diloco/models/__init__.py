"""Models: our GPT and CNN, and the presets (models/*.json, any mlx-lm architecture) in zoo.py."""
