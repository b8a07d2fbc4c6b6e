#!/usr/bin/env python3
"""L4 (TCP) proxying: meshless `protocol: tcp` against HAProxy `mode tcp`,
side by side in one run, each with one worker thread, on 127.0.0.1.

Scenarios (each proxy in turn, REPEATS rounds, medians):
  throughput   FLOWS long flows, each sending 256 KiB writes for DURATION
               seconds to a backend that discards them: MB/s through the
               proxy and proxy CPU seconds per GB.
  connections  CONCURRENCY clients that each connect, read the backend's
               6-byte greeting and close, for DURATION seconds:
               connections per second and proxy CPU microseconds each.

The backend and the load generator are this script (asyncio, one process
each); CPU is the proxy process's utime + stime from /proc. Needs
haproxy and target/release/meshless (`cargo build --release -p meshless`).

    python3 bench/l4_peers.py            # DURATION=5 REPEATS=3
    DURATION=2 REPEATS=1 python3 bench/l4_peers.py
"""

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from peers_common import cpu_seconds, spawn, wait_port

DURATION = float(os.environ.get("DURATION", "5"))
REPEATS = int(os.environ.get("REPEATS", "3"))
FLOWS = int(os.environ.get("FLOWS", "8"))
CONCURRENCY = int(os.environ.get("CONCURRENCY", "32"))
MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
BACKENDS = (28100, 28101)
PORTS = {"haproxy": 28201, "meshless": 28203}
CHUNK = b"x" * (256 * 1024)

HAPROXY_CONF = """
global
  nbthread 1
  maxconn 9000
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend fe
  bind 127.0.0.1:28201
  default_backend be
backend be
  balance source
  hash-type consistent
  server s1 127.0.0.1:28100
  server s2 127.0.0.1:28101
"""

MESHLESS_CONF = """
admin: { address: "127.0.0.1:28204" }
access_log: "off"
listeners:
  - name: l4
    address: 127.0.0.1:28203
    protocol: tcp
    max_connections: 9000
    tcp: { cluster: be, flow_key: source_ip }
clusters:
  - name: be
    balancer: { policy: maglev }
    endpoints: [{ address: "127.0.0.1:28100" }, { address: "127.0.0.1:28101" }]
"""


async def serve_backend():
    async def conn(reader, writer):
        writer.write(b"hello\n")
        try:
            await writer.drain()
            while await reader.read(1 << 20):
                pass
        except ConnectionError:
            pass
        writer.close()

    servers = [await asyncio.start_server(conn, "127.0.0.1", p, backlog=4096) for p in BACKENDS]
    await asyncio.gather(*(s.serve_forever() for s in servers))


def start(name, workdir):
    if name == "haproxy":
        path = f"{workdir}/haproxy.cfg"
        open(path, "w").write(HAPROXY_CONF)
        cmd = ["haproxy", "-db", "-f", path]
    else:
        path = f"{workdir}/meshless.yaml"
        open(path, "w").write(MESHLESS_CONF)
        cmd = [MESHLESS, "proxy", "--threads", "1", "--config", path]
    return spawn(cmd, PORTS[name], f"{workdir}/{name}.log", timeout=10)


async def throughput(port):
    """Bytes sent by FLOWS flows in DURATION seconds (each flow ends with
    a write shutdown and waits for the backend's close: nothing in flight
    is counted twice)."""
    stop = time.monotonic() + DURATION

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await reader.readexactly(6)
        sent = 0
        while time.monotonic() < stop:
            writer.write(CHUNK)
            await writer.drain()
            sent += len(CHUNK)
        writer.write_eof()
        await reader.read()
        writer.close()
        return sent

    return sum(await asyncio.gather(*(one() for _ in range(FLOWS))))


async def connections(port):
    """Connections opened, greeted and closed in DURATION seconds."""
    stop = time.monotonic() + DURATION

    async def one():
        n = 0
        while time.monotonic() < stop:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.readexactly(6)
            writer.close()
            await writer.wait_closed()
            n += 1
        return n

    return sum(await asyncio.gather(*(one() for _ in range(CONCURRENCY))))


def measure(pid, scenario, port):
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    count = asyncio.run(scenario(port))
    cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - t0
    return count, cpu, wall


def main():
    if not os.path.exists(MESHLESS):
        sys.exit(f"{MESHLESS} missing: cargo build --release -p meshless")
    backend = subprocess.Popen([sys.executable, __file__, "backend"])
    for p in BACKENDS:
        wait_port(p)
    rows = {}
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for r in range(REPEATS):
                order = ["haproxy", "meshless"] if r % 2 == 0 else ["meshless", "haproxy"]
                for name in order:
                    proc = start(name, workdir)
                    try:
                        n, cpu, wall = measure(proc.pid, throughput, PORTS[name])
                        rows.setdefault((name, "mb_s"), []).append(n / wall / 1e6)
                        rows.setdefault((name, "cpu_per_gb"), []).append(cpu / (n / 1e9))
                        n, cpu, wall = measure(proc.pid, connections, PORTS[name])
                        rows.setdefault((name, "conn_s"), []).append(n / wall)
                        rows.setdefault((name, "us_per_conn"), []).append(cpu / n * 1e6)
                    finally:
                        proc.terminate()
                        proc.wait()
    finally:
        backend.terminate()
        backend.wait()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"DURATION={DURATION:g} REPEATS={REPEATS} FLOWS={FLOWS} CONCURRENCY={CONCURRENCY}; medians")
    print()
    print("| proxy | throughput MB/s | CPU s per GB | connections/s | CPU µs per connection |")
    print("|---|---|---|---|---|")
    for name in ("haproxy", "meshless"):
        print(
            f"| {name} | {med[(name, 'mb_s')]:.0f} | {med[(name, 'cpu_per_gb')]:.3f} "
            f"| {med[(name, 'conn_s')]:.0f} | {med[(name, 'us_per_conn')]:.1f} |"
        )
    h, m = "haproxy", "meshless"
    print()
    print(
        f"meshless / haproxy: CPU per GB x{med[(m, 'cpu_per_gb')] / med[(h, 'cpu_per_gb')]:.2f}, "
        f"CPU per connection x{med[(m, 'us_per_conn')] / med[(h, 'us_per_conn')]:.2f}"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["backend"]:
        asyncio.run(serve_backend())
    else:
        main()
