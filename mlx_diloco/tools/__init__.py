"""What the commands run beside training: `plan` (what-if estimates), `plot` (loss curves),
`doctor` (this machine, checked), `export` (a run's model for mlx-lm), `generate` (sampling)."""
