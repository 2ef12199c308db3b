"""How far a run is: the steps it has taken and the measured compute time of one worker, which a
checkpoint keeps and a joiner takes from a member (elastic.py)."""


class RunClock:
    def __init__(self):
        self.steps = 0          # steps done (the job-wide tick)
        self.compute_s = 0.0    # measured compute time of one worker (its ticks, as speeds.py models them)
