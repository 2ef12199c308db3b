"""Model presets (JSON). Installed as the package mlx_diloco.presets so that pip installs carry them."""
