"""The training loop shared by sim, the cluster worker and the API: the run (run.py), the replicas one
process trains (workers.py), workers of different speeds (pacing.py), who hears the run's reports
(callbacks.py), checkpoints and metrics."""
