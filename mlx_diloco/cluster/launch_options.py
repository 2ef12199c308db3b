"""`launch`'s options, each declared once with its help: the command's flags are derived from the
fields (cli.py's add_flag), and RUN/launch.json keeps them. MLX-free."""

from dataclasses import dataclass

from ..options import option


@dataclass
class LaunchOptions:
    on_loss: str = option("shrink", "when a machine is lost: go on with the rest, or wait for it to return",
                          choices=("shrink", "wait"))
    min_workers: int = option(1, "the fewest workers the job goes on with after losing machines; below, it waits "
                                 "for them")
    max_workers: int = option(0, "the most workers machines joining mid-run make (default: --workers)")
    add: str = option("", "machines to admit as they answer (HOST[:PORT],...), each at the next sync point (a free "
                          "worker slot)")
    collective_timeout: float = option(30.0, "seconds a worker may wait in a collective (or between steps) before "
                                             "it counts as stalled")
    heartbeat_timeout: float = option(5.0, "seconds an agent may stay silent before its machine counts as lost")
    max_restarts: int = option(5, "restarts before the job is given up")
    data_on_workers: bool = option(False, "the --data path exists on every machine: read it there instead of "
                                          "shipping shards")
    backend: str = option("auto", "MLX's backend between the workers: jaccl (RDMA over Thunderbolt 5: macOS 26.2+, "
                                  "RDMA enabled, ring neighbours cabled), ring (TCP), or auto: jaccl where it can "
                                  "run, else the ring, saying why (a hostfile's backend counts as auto)",
                          choices=("auto", "ring", "jaccl"))
    measure_links: bool = option(False, "first measure every pair's link (as 'mlx-diloco links' does) and order the "
                                        "ring by it (without: by the agents' kept measurements where every pair "
                                        "has one)")
    # Not flags: what the launcher works out, and its patience.
    discover: bool = option(False, "the agents were found over mDNS: new ones found there may join", flag=False)
    startup_timeout: float = option(300.0, "seconds a worker may take to report its first step", flag=False)
    stop_grace: float = option(5.0, "seconds a worker has to save its state and exit before it is stopped", flag=False)
