"""The training loop shared by sim, the cluster worker and the API: the run (run.py), the replicas one
process trains (workers.py), checkpoints and metrics."""
