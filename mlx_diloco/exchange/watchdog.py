"""The watchdog around every wait on a peer (MLX's ring waits forever on a peer that stalls):
past the timeout the process prints every thread's stack and exits. No MLX here: the agent
imports the exit mark to recognise such an exit."""

import faulthandler
import sys
from contextlib import contextmanager

WATCHDOG_EXIT_MARK = "Timeout ("  # how faulthandler's dump starts; the agent looks for it


@contextmanager
def watchdog(timeout_s: float):
    """Exit the process if the block has not finished after `timeout_s` seconds."""
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
