"""The gym: fixed benchmark problems (problems.py), a run's scorecard (scorecard.py) and sweeps over
a grid (sweep.py). Runs themselves are ordinary simulator runs (training/processes.simulate)."""
