"""The real cluster's control plane: the agent each Mac runs, the signed msgpack protocol, discovery
(mDNS or host lists), ring planning, what a machine reports of itself, and the launcher."""
