"""The dashboard under a flood of idle connections (issue 43): `mlx-diloco dashboard RUN --host
0.0.0.0` under macOS's default 256 open files (ulimit -n 256), and a client without the token that
opens FLOOD connections and sends nothing. Reported per try: the seconds the token holder waits for
the page (/) and for the run's data (/api/run), each on a new connection as a browser's first load
opens them, asked as soon as the flood is in; the files the dashboard holds then, and whether
accept() ran out of them (EMFILE: asyncio then waits a second before it accepts again).

    .venv/bin/python bench/dashboard_flood.py [--flood 250] [--tries 3]     # seconds on a 2-core machine
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def printed_url(log: Path, proc) -> str:
    while True:
        for line in log.read_text().splitlines():
            if line.startswith("dashboard") and "http://" in line:
                return line[line.index("http://"):].split()[0]
        if proc.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.1)


def seconds_to_get(url: str) -> float:
    start = time.perf_counter()
    urllib.request.urlopen(url, timeout=60).read()
    return time.perf_counter() - start


def one_try(flood: int) -> dict:
    folder = Path(tempfile.mkdtemp())
    run = folder / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"strategy": "diloco", "workers": 2, "model": "tiny"}))
    log = folder / "dashboard.log"
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # noqa: E731
    served = subprocess.Popen([sys.executable, "-m", "mlx_diloco", "dashboard", str(run), "--host", "0.0.0.0",
                               "--port", "0"], stdout=subprocess.DEVNULL, stderr=open(log, "w"), preexec_fn=limit)
    idle = []
    try:
        url = printed_url(log, served)
        port, token = int(url.split(":")[2].split("/")[0]), url.split("token=")[1]
        for _ in range(flood):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            idle.append(sock)
        page = seconds_to_get(f"http://127.0.0.1:{port}/?token={token}")  # at once, as the flood goes in
        data = seconds_to_get(f"http://127.0.0.1:{port}/api/run?token={token}")
        time.sleep(0.5)
        files = len(os.listdir(f"/proc/{served.pid}/fd"))
        return {"flood": flood, "files_held": files, "page_s": round(page, 3), "api_run_s": round(data, 3),
                "emfile": "Too many open files" in log.read_text()}
    finally:
        for sock in idle:
            sock.close()
        served.kill()
        served.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=250, help="idle connections opened before the page's")
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    for _ in range(args.tries):
        for flood in (0, args.flood):
            print(json.dumps(one_try(flood)), flush=True)


if __name__ == "__main__":
    main()
