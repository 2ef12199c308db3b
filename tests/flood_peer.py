"""A peer without the cluster secret flooding an agent, in its own process (so that it floods at
its own pace, not the test's): `python flood_peer.py PORT churn THREADS CONNECTIONS` opens and
closes CONNECTIONS connections as fast as THREADS threads can; `... PORT hold THREADS SECONDS`
keeps THREADS connections open, each reopened as soon as the agent closes it. It prints "ready"
once it floods, then "<n> connections in <s> s". Only to 127.0.0.1."""

import socket
import sys
import threading
import time


def churn(port: int, count: int, opened: list):
    for _ in range(count):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            opened.append(1)
        except OSError:
            pass


def hold(port: int, until: float, opened: list):
    while time.monotonic() < until:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=max(0.1, until - time.monotonic()))
            opened.append(1)
            while sock.recv(4096):  # sends nothing; waits for the agent to close it
                pass
            sock.close()
        except OSError:
            pass


def main(port: int, mode: str, threads: int, amount: float):
    opened, start = [], time.monotonic()
    if mode == "churn":
        workers = [threading.Thread(target=churn, args=(port, int(amount) // threads, opened)) for _ in range(threads)]
    else:
        workers = [threading.Thread(target=hold, args=(port, start + amount, opened)) for _ in range(threads)]
    for w in workers:
        w.start()
    while mode == "hold" and len(opened) < threads:  # every thread holds a connection
        time.sleep(0.01)
    print("ready", flush=True)
    for w in workers:
        w.join()
    print(f"{len(opened)} connections in {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
