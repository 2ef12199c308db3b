"""The same DiLoCo code over the real MLX ring backend (processes on 127.0.0.1) ends with the
same parameters as the simulator."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
from mlx.utils import tree_flatten

from conftest import tiny_config
from mlx_diloco import checkpoint
from mlx_diloco.comm import SimCommunicator
from mlx_diloco.train import Run


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_ring_run_matches_sim(tmp_path):
    config = tiny_config(workers=2, steps=8, sync_every=4, compress="fp16")
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(config.to_dict()))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = [subprocess.Popen([sys.executable, "-m", "mlx_diloco", "worker", "--config", cfg,
                               "--run-dir", tmp_path / "ring"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:  # a rank whose peer died would otherwise wait in a collective forever
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs

    sim = Run(config, tmp_path / "sim", SimCommunicator(2), log=lambda m: None)
    sim.train()
    ring_state, _ = checkpoint.load(tmp_path / "ring")
    ring_global = dict(tree_flatten(ring_state["strategy"]["global"]))
    for k, v in tree_flatten(sim.strategy.global_params(None)):
        np.testing.assert_allclose(np.array(ring_global[k]), np.array(v), rtol=1e-3, atol=1e-5, err_msg=k)
    rows = [json.loads(l) for l in (tmp_path / "ring" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 8 and rows[-1]["bytes_sent_per_worker"] == sim.bytes_sent
