"""The exchange between workers: the communication interface (comm.py) and its two transports,
the simulator's and MLX's ring (ring.py), the codecs of what goes on the wire, and the network model."""
