#!/usr/bin/env python3
"""Latency of the first requests of a burst, with and without pre-connect
(cluster `connection_pool.preconnect_ratio`, Envoy's
`per_upstream_preconnect_ratio`). Loopback only.

An nginx backend (TLS with a certificate made here by openssl, or
cleartext with TLS=0) behind `meshless proxy --threads 1`. Each round
starts a fresh proxy (a cold pool), opens 64 keep-alive client
connections, then sends waves of 1, 2, 4, ..., 64 requests at once, one per
client connection, each wave after the previous one answered. Without
pre-connect, each wave waits for the upstream connections (and TLS
handshakes) it needs beyond the previous wave's; with a ratio of 2 the
previous wave has opened them in the background. Prints the mean latency
of each wave and of the whole ramp, medians over ROUNDS rounds.

  python3 bench/preconnect.py                       # TLS upstream, ratios 1 and 2
  TLS=0 ROUNDS=30 python3 bench/preconnect.py
  MESHLESS=target/debug/meshless RATIOS=1,3 python3 bench/preconnect.py
"""

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from peers_common import wait_port

MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
ROUNDS = int(os.environ.get("ROUNDS", "20"))
RATIOS = [float(r) for r in os.environ.get("RATIOS", "1,2").split(",")]
TLS = os.environ.get("TLS", "1") != "0"
WAVES = [1, 2, 4, 8, 16, 32, 64]
BACKEND, PROXY, ADMIN = 18200, 18203, 18204

NGINX = """
worker_processes 1; daemon off; pid {dir}/nginx.pid; error_log {dir}/nginx.err;
events {{ worker_connections 4096; }}
http {{
  access_log off; keepalive_requests 100000000; keepalive_timeout 300s;
  server {{
    listen 127.0.0.1:{port} {ssl};
    {certs}
    location / {{ return 200 "hello from the backend\\n"; }}
  }}
}}
"""

PROXY_CONF = """
admin: {{ address: "127.0.0.1:{admin}" }}
access_log: "off"
listeners:
  - name: bench
    address: 127.0.0.1:{proxy}
    routes: [{{ cluster: backend }}]
clusters:
  - name: backend
    endpoints: [{{ address: "127.0.0.1:{backend}" }}]
    connection_pool: {{ preconnect_ratio: {ratio} }}
{tls}"""


def certificates(d):
    """A CA and a server certificate for `backend.bench` signed by it."""
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, cwd=d)
    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=bench CA")
    run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=backend.bench")
    with open(os.path.join(d, "ext"), "w") as f:
        f.write("subjectAltName=DNS:backend.bench\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext")


async def request(conn):
    r, w = conn
    t = time.perf_counter()
    w.write(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
    head = await r.readuntil(b"\r\n\r\n")
    length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n")
                  if l.lower().startswith(b"content-length"))
    await r.readexactly(length)
    if not head.startswith(b"HTTP/1.1 200"):
        sys.exit(f"bad answer: {head!r}")
    return time.perf_counter() - t


async def ramp():
    conns = [await asyncio.open_connection("127.0.0.1", PROXY) for _ in range(max(WAVES))]
    means = []
    for k in WAVES:
        lat = await asyncio.gather(*(request(c) for c in conns[:k]))
        means.append(statistics.mean(lat))
        # Background connects of the previous wave have time to land, as
        # they would between bursts of real traffic.
        await asyncio.sleep(0.05)
    for _, w in conns:
        w.close()
    return means


def round_with(ratio, d):
    tls = ""
    if TLS:
        tls = (f'    tls: {{ ca_file: "{d}/ca.pem", server_name: backend.bench }}\n')
    conf = os.path.join(d, "proxy.yaml")
    with open(conf, "w") as f:
        f.write(PROXY_CONF.format(admin=ADMIN, proxy=PROXY, backend=BACKEND, ratio=ratio, tls=tls))
    p = subprocess.Popen([MESHLESS, "proxy", "--threads", "1", "--config", conf],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(PROXY, 30)
        return asyncio.run(ramp())
    finally:
        p.terminate()
        p.wait()


def main():
    with tempfile.TemporaryDirectory() as d:
        ssl, certs = "", ""
        if TLS:
            certificates(d)
            ssl = "ssl"
            certs = f"ssl_certificate {d}/server.pem; ssl_certificate_key {d}/server.key;"
        with open(os.path.join(d, "nginx.conf"), "w") as f:
            f.write(NGINX.format(dir=d, port=BACKEND, ssl=ssl, certs=certs))
        nginx = subprocess.Popen(["nginx", "-c", os.path.join(d, "nginx.conf")])
        try:
            wait_port(BACKEND, 30)
            results = {r: [] for r in RATIOS}
            for _ in range(ROUNDS):
                for r in RATIOS:  # interleaved: both see the same machine load
                    results[r].append(round_with(r, d))
        finally:
            nginx.terminate()
            nginx.wait()
    print(f"upstream {'TLS' if TLS else 'cleartext'}, {ROUNDS} rounds, median of each wave's mean latency (µs)")
    print("ratio  " + "".join(f"{k:>8}" for k in WAVES) + "   ramp total")
    for r, rounds in results.items():
        waves = [statistics.median(x[i] for x in rounds) * 1e6 for i in range(len(WAVES))]
        total = statistics.median(sum(x) for x in rounds) * 1e6
        print(f"{r:<6} " + "".join(f"{w:8.0f}" for w in waves) + f"   {total:10.0f}")


if __name__ == "__main__":
    main()
