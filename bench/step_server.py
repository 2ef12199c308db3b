"""The protocol of bench/throughput.py's step processes, for every step it measures (the project's,
plain MLX's, PyTorch's), each in its own process so that each peak memory is its own.

The process prints `ready LABEL`, then for each line it reads: `step` runs one step (returning once
its results are computed) and prints `done`; `peak` prints the peak memory in bytes (or `-`).
Imports nothing: the baselines import no project code.
"""

import statistics
import sys
import time


def serve(step, label: str, peak_bytes):
    print(f"ready {label}", flush=True)
    for line in sys.stdin:
        if line.strip() == "peak":
            peak = peak_bytes()
            print(peak if peak is not None else "-", flush=True)
        else:
            step()
            print("done", flush=True)


def step_times(step, steps: int, warmup: int = 3) -> tuple:
    """Run alone (not served): the best and the median seconds of `steps` steps after `warmup`."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)
