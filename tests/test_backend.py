"""RDMA over Thunderbolt 5 (issue 25): which backend a ring runs on (jaccl where every Mac can,
else MLX's ring, saying why), MLX's hostfile as mlx.distributed_config writes it, and `launch
--backend/--hostfile/--dry-run` against real agents. Only the configuration and the fallback to
the ring run here: jaccl itself needs Macs cabled with Thunderbolt 5 (check those by hand with
`launch --dry-run`)."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from mlx_diloco.cluster.agent import Agent, Refused
from mlx_diloco.cluster.backend import choose_backend, device_matrix, plan
from mlx_diloco.cluster.hostfile import MlxHostfile, is_full_mesh
from mlx_diloco.cluster.hostinfo import parse_ibv_devinfo
from mlx_diloco.options import ConfigError
from mlx_diloco.worker_job import WorkerJob

DATA = Path(__file__).parent / "data"
SECRET = "backend-test-secret-0123456789"
LINUX_REASON = "runs Linux (jaccl needs macOS 26.2+ with RDMA over Thunderbolt 5)"


def mac(name, lan, cables, rdma_state="PORT_ACTIVE", macos="26.2", mlx="0.32.4", tb_addresses=()):
    """A Mac's hello: `cables` {interface: (its port's UUID, the UUID of the port at the other end)}."""
    nets = [{"name": "en0", "kind": "ethernet", "address": lan, "prefix": 24}]
    nets += [{"name": f"tb{k}", "kind": "thunderbolt", "address": a, "prefix": 30} for k, a in enumerate(tb_addresses)]
    return {"host": name, "platform": "darwin", "macos": macos, "mlx": mlx, "interfaces": nets,
            "thunderbolt": [{"interface": i, "domain_uuid": own, "peer_uuid": peer} for i, (own, peer) in cables.items()],
            "rdma": {f"rdma_{i}": rdma_state for i in cables}}


def cabled(names, cables):
    """Macs joined by `cables` [(mac a, its interface, mac b, its interface)]: their hellos."""
    ports = {n: {} for n in names}
    for k, (a, ia, b, ib) in enumerate(cables):
        ports[a][ia] = (f"{a}-{ia}", f"{b}-{ib}")
        ports[b][ib] = (f"{b}-{ib}", f"{a}-{ia}")
    return [mac(n, f"10.0.0.{i + 1}", ports[n]) for i, n in enumerate(names)]


# ---------------------------------------------------------------- what the agents report

def test_rdma_devices_and_their_port_states_from_ibv_devinfo():
    """The format Apple's TN3205 shows: one hca_id per Thunderbolt port, its port's state."""
    found = parse_ibv_devinfo((DATA / "ibv_devinfo.txt").read_text())
    assert found == {"rdma_en2": "PORT_ACTIVE", "rdma_en3": "PORT_ACTIVE", "rdma_en4": "PORT_DOWN"}
    assert parse_ibv_devinfo("") == {} and parse_ibv_devinfo("No IB devices found\n") == {}


def test_this_linux_machine_reports_no_rdma_and_no_macos():
    from mlx_diloco.cluster.hostinfo import describe
    me = describe("test")
    assert me["rdma"] == {} and me["macos"] == "" and me["mlx"]  # the version, read without importing MLX


# ---------------------------------------------------------------- the choice

def test_auto_takes_jaccl_on_a_full_mesh_of_macs_with_rdma():
    agents = cabled("abc", [("a", "en2", "b", "en3"), ("b", "en2", "c", "en4"), ("c", "en2", "a", "en3")])
    devices = device_matrix(agents)
    # Each side names its own end of the cable, as mlx.distributed_config does (rdma_ and the interface).
    assert devices == [[None, "rdma_en2", "rdma_en3"], ["rdma_en3", None, "rdma_en2"], ["rdma_en2", "rdma_en4", None]]
    assert choose_backend("auto", agents, devices) == \
        ("jaccl", "every Mac runs macOS 26.2+ with RDMA, with a full mesh of RDMA links")


def test_jaccl_needs_only_the_ring_neighbours_cabled():
    """Four Macs cabled a-b-c-d-a: no mesh, but jaccl's ring group runs on it (jaccl.cpp `init`)."""
    agents = cabled("abcd", [("a", "en2", "b", "en2"), ("b", "en3", "c", "en2"), ("c", "en3", "d", "en2"),
                             ("d", "en3", "a", "en3")])
    devices = device_matrix(agents)
    assert not is_full_mesh(devices) and devices[0][2] is None
    assert choose_backend("auto", agents, devices)[0] == "jaccl"
    # The same Macs in the order a, c, b, d: a and c are neighbours without a cable.
    shuffled = [agents[i] for i in (0, 2, 1, 3)]
    backend, reason = choose_backend("auto", shuffled, device_matrix(shuffled))
    assert backend == "ring" and reason.startswith("no RDMA link between ring neighbours a and c")


def test_two_cables_between_a_pair_pair_the_same_cable_on_both_sides():
    agents = cabled("ab", [("a", "en2", "b", "en5"), ("a", "en3", "b", "en4")])
    assert device_matrix(agents) == [[None, ["rdma_en2", "rdma_en3"]], [["rdma_en5", "rdma_en4"], None]]


@pytest.mark.parametrize("change, reason", [
    ({"platform": "linux"}, f"b {LINUX_REASON}"),
    ({"macos": "15.5"}, "b runs macOS 15.5 (jaccl needs macOS 26.2+ with RDMA over Thunderbolt 5: update macOS)"),
    ({"mlx": "0.29.3"}, "b has MLX 0.29.3 (jaccl needs MLX 0.30.1+: pip install -U mlx there)"),
    ({"rdma": {}}, "b has no RDMA device (jaccl needs macOS 26.2+ with RDMA over Thunderbolt 5: enable RDMA once: "
                   "`rdma_ctl enable` in macOS Recovery, then reboot)"),
    ({"rdma": {"rdma_en3": "PORT_DOWN"}}, "rdma_en3 on b (cable to a) is PORT_DOWN: RDMA must be enabled on both "
                                          "Macs (enable RDMA once: `rdma_ctl enable` in macOS Recovery, then reboot)"),
])
def test_auto_falls_back_to_the_ring_and_says_why(change, reason):
    agents = cabled("ab", [("a", "en2", "b", "en3")])
    agents[1].update(change)
    assert choose_backend("auto", agents, device_matrix(agents)) == ("ring", reason)


def test_backend_jaccl_that_cannot_run_is_one_line_naming_the_host_and_the_fix():
    agents = cabled("ab", [("a", "en2", "b", "en3")])
    agents[1]["platform"] = "linux"
    with pytest.raises(ConfigError) as e:
        choose_backend("jaccl", agents, device_matrix(agents))
    assert str(e.value) == (f"--backend jaccl cannot run here: b {LINUX_REASON}; fix that, or pass --backend auto "
                            "(it falls back to the ring)")
    assert choose_backend("ring", cabled("ab", [("a", "en2", "b", "en3")]), [[None, "x"], ["y", None]])[0] == "ring"


# ---------------------------------------------------------------- MLX's hostfile

# As mlx.distributed_config writes them (mlx/_distributed_utils/config.py): a ring over Thunderbolt
# lists where each rank listens (its end of the cable from the rank before it, `configure_ring`);
# jaccl the Macs' en0 addresses and, per peer, the device of the cable to it (`configure_jaccl`);
# jaccl-ring a list per neighbour when two cables join it (`configure_jaccl_ring`).
RING = {"backend": "ring", "envs": [], "hosts": [
    {"ssh": "mini1", "ips": ["192.168.0.6"], "rdma": []},
    {"ssh": "mini2", "ips": ["192.168.0.2"], "rdma": []},
    {"ssh": "mini3", "ips": ["192.168.0.5"], "rdma": []}]}
JACCL = {"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [
    {"ssh": "mini1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en2", "rdma_en3"]},
    {"ssh": "mini2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None, "rdma_en2"]},
    {"ssh": "mini3", "ips": ["10.0.0.3"], "rdma": ["rdma_en4", "rdma_en2", None]}]}
JACCL_RING = {"backend": "jaccl-ring", "envs": [], "hosts": [
    {"ssh": "me@mini1", "ips": ["10.0.0.1"], "rdma": [None, ["rdma_en2", "rdma_en3"]]},
    {"ssh": "me@mini2", "ips": ["10.0.0.2"], "rdma": [["rdma_en5", "rdma_en4"], None]}]}


@pytest.mark.parametrize("data", [RING, JACCL, JACCL_RING, RING["hosts"]], ids=["ring", "jaccl", "jaccl-ring", "list"])
def test_hostfiles_as_mlx_writes_them_are_read_and_written_back_as_mlx_reads_them(tmp_path, data):
    from mlx._distributed_utils.common import Hostfile  # MLX's own reader (no MLX core needed)
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data))
    file = MlxHostfile.read(path)
    hosts = data["hosts"] if isinstance(data, dict) else data
    assert [h.ssh for h in file.hosts] == [h["ssh"] for h in hosts] and [h.ips for h in file.hosts] == [h["ips"] for h in hosts]
    file.write(tmp_path / "again.json")
    assert MlxHostfile.read(tmp_path / "again.json") == file
    assert Hostfile.from_file(tmp_path / "again.json").to_json() == file.to_json() == Hostfile.from_file(path).to_json()
    assert file.hosts[0].agent_address == "mini1"  # ssh's user@ is not part of the agent's address


@pytest.mark.parametrize("text, problem", [
    ("{not json", "is not an MLX hostfile: not valid JSON"),
    ('{"hosts": {}}', 'it has no "hosts" list'),
    ('{"hosts": [{"ips": ["10.0.0.1"]}]}', 'host 0 has no "ssh" name'),
    ('{"backend": "mpi", "hosts": [{"ssh": "a"}]}', "backend 'mpi' is not one mlx-diloco runs (ring or jaccl)"),
    ('{"hosts": [{"ssh": "a", "ips": "10.0.0.1"}]}', 'host a: "ips" must be a list of addresses'),
    ('{"hosts": [{"ssh": "a", "rdma": [null, "x"]}, {"ssh": "b"}, {"ssh": "c"}]}', "host a lists 2 RDMA entries for 3 hosts"),
    ('{"hosts": [{"ssh": "a", "rdma": ["rdma_en2", null]}, {"ssh": "b", "rdma": ["rdma_en2", null]}]}',
     "host a lists an RDMA device to itself"),
    ('{"backend": "jaccl", "hosts": [{"ssh": "a", "rdma": [null, "rdma_en2"]}, {"ssh": "b", "rdma": [null, null]}]}',
     "backend jaccl but no RDMA device is listed for b to a"),
    ('{"hosts": [{"ssh": "a"}, {"ssh": "me@a"}]}', "a is listed twice (one agent runs one worker); list each Mac once"),
])
def test_a_malformed_hostfile_is_one_line_naming_the_problem_and_the_fix(tmp_path, text, problem):
    path = tmp_path / "hosts.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        MlxHostfile.read(path)
    assert problem in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)
    assert "; " in str(e.value)  # ...and what to do


def test_a_jaccl_hostfile_makes_the_ring_and_the_devices_and_the_ring_goes_on_when_a_mac_leaves():
    file = MlxHostfile.from_json(JACCL)
    agents = cabled(["mini1", "mini2", "mini3"], [("mini1", "en2", "mini2", "en3"), ("mini2", "en2", "mini3", "en2"),
                                                  ("mini3", "en4", "mini1", "en3")])
    found = ["mini3", "mini1", "mini2"]  # the agents answered in another order: the file's order counts
    by_name = {a["host"]: a for a in agents}
    p = plan("auto", [by_name[n] for n in found], found, ([0, 1, 2], [["x"]] * 3, ["lan"] * 3), file)
    assert p.order == [1, 2, 0] and p.hosts == ["mini1", "mini2", "mini3"] and p.backend == "jaccl"
    assert p.devices == [h["rdma"] for h in JACCL["hosts"]] and p.lan == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    written = p.mlx_hostfile(file.envs).to_json()
    assert written == JACCL  # what mlx.launch --backend jaccl would run, the coordinator rank 0's ip
    # mini2 leaves: the other two keep the file's devices between them.
    p = plan("auto", [by_name["mini1"], by_name["mini3"]], ["mini1", "mini3"], ([0, 1], [["x"]] * 2, ["lan"] * 2), file)
    assert p.devices == [[None, "rdma_en3"], ["rdma_en4", None]] and p.backend == "jaccl"


def test_a_ring_hostfile_keeps_its_addresses_while_each_rank_keeps_its_predecessor():
    file = MlxHostfile.from_json(RING)
    agents = [{"host": n, "platform": "linux", "interfaces": [], "thunderbolt": [], "rdma": {}} for n in ("mini1", "mini2", "mini3")]
    p = plan("auto", agents, ["mini1", "mini2", "mini3"], ([0, 1, 2], [["x"]] * 3, ["lan"] * 3), file)
    assert p.addresses == [["192.168.0.6"], ["192.168.0.2"], ["192.168.0.5"]] and p.backend == "ring"
    assert p.reason == f"mini1 {LINUX_REASON}" and p.mlx_hostfile().to_json() == RING
    # Without mini2, mini3 follows mini1: its address was its end of mini2's cable, so it listens on its LAN
    # address; mini1 still follows mini3 and keeps its end of their cable.
    p = plan("auto", [agents[0], agents[2]], ["mini1", "mini3"], ([0, 1], [["x"]] * 2, ["lan"] * 2), file)
    assert p.addresses == [["192.168.0.6"], ["mini3"]]


# ---------------------------------------------------------------- the agent starts a jaccl worker as mlx.launch does

def test_the_agent_starts_a_jaccl_worker_with_mlx_launchs_variables_and_refuses_a_bad_matrix(tmp_path):
    from conftest import tiny_config
    agent = Agent(tmp_path / "agent", SECRET.encode())
    worker = WorkerJob(tiny_config(workers=2).to_dict(), data_worker=1, collective_timeout=5.0, backend="jaccl")
    start = {"job": "j", "rank": 1, "hostfile": [["10.0.0.1:5000"], ["10.0.0.2:5000"]], "worker": worker.for_agent(),
             "files": {}, "coordinator": "10.0.0.1:5000"}
    for bad in ([[None, "rdma_en2"]], [[None, "rdma_en2"], [None, "rdma_en3"]], [[None, "en2; rm"], ["x", None]]):
        with pytest.raises(Refused, match="jaccl needs 'devices'"):
            agent.on_start({**start, "devices": bad})
    devices = [[None, "rdma_en2"], ["rdma_en3", None]]
    try:
        agent.on_start({**start, "devices": devices})
        folder = tmp_path / "agent" / "jobs" / "j"
        assert json.loads((folder / "devices.json").read_text()) == devices
        assert json.loads((folder / "job.json").read_text())["backend"] == "jaccl"
        env = open(f"/proc/{agent.jobs['j'].popen.pid}/environ", "rb").read().split(b"\0") \
            if sys.platform.startswith("linux") else None
        if env is not None:
            assert b"MLX_JACCL_COORDINATOR=10.0.0.1:5000" in env and b"MLX_RANK=1" in env
            assert f"MLX_IBV_DEVICES={folder / 'devices.json'}".encode() in env
    finally:
        agent.stop_all()


# ---------------------------------------------------------------- launch, against real agents

def start_agent(tmp_path, name, bind="127.0.0.1", port=0):
    out = tmp_path / f"{name}.out"
    proc = subprocess.Popen([sys.executable, "-m", "mlx_diloco", "agent", "--no-mdns", "--bind", bind, "--port", str(port),
                             "--name", name, "--state-dir", str(tmp_path / name)],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / f"{name}.log", "w"), text=True,
                            env={**os.environ, "MLX_DILOCO_SECRET": SECRET})
    line = proc.stdout.readline()
    found = re.search(r"ready on port (\d+)", line)
    if not found:
        proc.kill()
        raise RuntimeError(f"agent {name} did not start: {(tmp_path / f'{name}.log').read_text()[-500:]} {out}")
    return proc, int(found.group(1))


@pytest.fixture
def agents(tmp_path):
    started = [start_agent(tmp_path, name) for name in ("a1", "a2")]
    yield [port for _, port in started]
    for proc, _ in started:
        proc.terminate()
        proc.wait(timeout=10)


def test_launch_backend_auto_dry_run_chooses_the_ring_on_linux_and_says_why(agents, tmp_path):
    hosts = ",".join(f"127.0.0.1:{port}" for port in agents)
    out = run_cli("launch", "--hosts", hosts, "--backend", "auto", "--dry-run", "--run-dir", tmp_path / "run",
                  env={"MLX_DILOCO_SECRET": SECRET})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"backend ring: a1 {LINUX_REASON}\n")
    assert re.search(r"rank 0: a1 .* listens on 127\.0\.0\.1 .*\n  rank 1: a2 ", out.stdout)
    assert '"backend": "ring"' in out.stdout and out.stdout.rstrip().endswith("nothing was started (--dry-run)")
    assert not (tmp_path / "run").exists()
    out = run_cli("launch", "--hosts", hosts, "--backend", "jaccl", "--dry-run", env={"MLX_DILOCO_SECRET": SECRET})
    assert out.returncode == 2 and out.stderr.strip() == (
        f"mlx-diloco: error: --backend jaccl cannot run here: a1 {LINUX_REASON}; fix that, or pass --backend auto "
        "(it falls back to the ring)")


def _loopback_free(address: str, port: int) -> bool:
    try:
        with socket.create_server((address, port)):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs 127.0.0.2 and 127.0.0.3 (Linux's loopback)")
def test_launch_runs_a_job_on_the_machines_of_an_mlx_hostfile_and_writes_it_back(tmp_path):
    """An MLX hostfile names machines, not ports: its agents listen on the default port, here on two
    loopback addresses of this machine."""
    from mlx._distributed_utils.common import Hostfile
    from mlx_diloco.cluster.protocol import DEFAULT_PORT
    if not all(_loopback_free(a, DEFAULT_PORT) for a in ("127.0.0.2", "127.0.0.3")):
        pytest.skip(f"port {DEFAULT_PORT} is taken on 127.0.0.2 or 127.0.0.3")
    started = [start_agent(tmp_path, f"mac{i}", f"127.0.0.{i}", DEFAULT_PORT) for i in (2, 3)]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "envs": [], "hosts": [
        {"ssh": "127.0.0.2", "ips": ["127.0.0.2"], "rdma": []}, {"ssh": "me@127.0.0.3", "ips": ["127.0.0.3"], "rdma": []}]}))
    try:
        out = run_cli("launch", "--hostfile", hostfile, "--model", "tiny", "--seq-len", 16, "--batch-size", 4,
                      "--steps", 8, "--sync-every", 4, "--eval-sequences", 8, "--warmup", 2, "--run-dir", tmp_path / "run",
                      env={"MLX_DILOCO_SECRET": SECRET})
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait(timeout=10)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 workers, 8 steps" in out.stdout
    (started_event,) = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
                        if json.loads(line)["event"] == "started"]
    assert started_event["ring"] == "mac2(lan) -> mac3(lan)" and started_event["backend"] == "ring"
    assert started_event["backend_reason"] == f"mac2 {LINUX_REASON}"
    # The ring it ran, in MLX's format: mlx.launch --hostfile RUN/hostfile.json runs on the same machines.
    assert Hostfile.from_file(tmp_path / "run" / "hostfile.json").to_json() == json.loads(hostfile.read_text())
