"""The training loop shared by sim, the cluster worker and the API: the run (run.py), the replicas one
process trains (workers.py), who steps at each tick (pacing.py: workers of different speeds, or a
membership schedule), who hears the run's reports (callbacks.py), checkpoints and metrics."""
