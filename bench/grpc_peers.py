#!/usr/bin/env python3
"""Driver of bench/grpc-peers.sh: unary gRPC calls direct, through HAProxy
and through meshless; CPU per call of the proxy and of the backend,
measured from /proc over the same run. Loopback only."""

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from peers_common import cpu_seconds, spawn, stop

DURATION = int(os.environ.get("DURATION", "5"))
REPEATS = int(os.environ.get("REPEATS", "3"))
MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
BACKEND, HAPROXY, PROXY, ADMIN = 18100, 18101, 18102, 18103
PORTS = {"direct": BACKEND, "haproxy": HAPROXY, "meshless": PROXY}
TARGETS = ["direct", "haproxy", "meshless"]
PATH = "/meshless.echo.v1.Echo/Unary"
# EchoRequest { message: "hi" }: field 1, length 2, "hi"; with gRPC's
# 5-byte prefix (not compressed, length 4).
MESSAGE = b"\x00\x00\x00\x00\x04\x0a\x02hi"

HAPROXY_CONF = f"""
global
  nbthread 1
  maxconn 9500
defaults
  mode http
  timeout connect 5s
  timeout client 300s
  timeout server 300s
frontend fe
  bind 127.0.0.1:{HAPROXY} proto h2
  default_backend be
backend be
  http-reuse always
  server s1 127.0.0.1:{BACKEND} proto h2
"""

MESHLESS_CONF = f"""
admin: {{ address: "127.0.0.1:{ADMIN}" }}
access_log: "off"
listeners:
  - name: bench
    address: 127.0.0.1:{PROXY}
    routes: [{{ cluster: echo }}]
clusters:
  - name: echo
    upstream_protocol: http2
    endpoints: [{{ address: "127.0.0.1:{BACKEND}" }}]
    circuit_breakers: {{ max_connections: 100000, max_pending: 100000, max_requests: 100000 }}
"""


def start(name, workdir):
    if name == "direct":
        return None
    if name == "haproxy":
        path = f"{workdir}/haproxy.cfg"
        open(path, "w").write(HAPROXY_CONF)
        return spawn(["haproxy", "-db", "-f", path], HAPROXY, f"{workdir}/haproxy.log")
    path = f"{workdir}/meshless.yaml"
    open(path, "w").write(MESHLESS_CONF)
    return spawn([MESHLESS, "proxy", "--threads", "1", "--config", path], PROXY, f"{workdir}/meshless.log")


def check(port):
    """One call with curl: the answer must name the backend and end with grpc-status 0."""
    out = subprocess.run(
        ["curl", "-sv", "--http2-prior-knowledge", "-H", "content-type: application/grpc",
         "-H", "te: trailers", "--data-binary", "@-", f"http://127.0.0.1:{port}{PATH}", "--output", "-"],
        input=MESSAGE, capture_output=True, timeout=10)
    if b"grpc-status: 0" not in out.stderr or b"bench-backend" not in out.stdout:
        sys.exit(f"port {port}: the echo call failed:\n{out.stderr.decode(errors='replace')}")


def h2load(port, msgfile, seconds):
    cmd = ["h2load", "-t1", "-c4", "-m32", f"-D{seconds}", "-d", msgfile,
           "-H", "content-type: application/grpc", "-H", "te: trailers", f"http://127.0.0.1:{port}{PATH}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    m = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded", out)
    if not m:
        sys.exit(f"h2load failed:\n{out}")
    done, ok = int(m.group(2)), int(m.group(3))
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean.group(2)]
    return ok, done - ok, float(mean.group(1)) * scale


def run(name, proc, backend, msgfile):
    port = PORTS[name]
    check(port)
    h2load(port, msgfile, 1)  # warm-up, not measured
    b0 = cpu_seconds(backend.pid)
    p0 = cpu_seconds(proc.pid) if proc else 0.0
    t0 = time.time()
    ok, failed, mean_ms = h2load(port, msgfile, DURATION)
    elapsed = time.time() - t0
    calls = max(ok, 1)
    return {
        "rps": ok / elapsed,
        "mean_ms": mean_ms,
        "proxy_us": (cpu_seconds(proc.pid) - p0) * 1e6 / calls if proc else 0.0,
        "backend_us": (cpu_seconds(backend.pid) - b0) * 1e6 / calls,
        "failed": failed,
    }


def fmt(v, digits=1):
    return "-" if v != v else f"{v:,.{digits}f}"


def main():
    workdir = tempfile.mkdtemp(prefix="meshless-grpc-bench-")
    msgfile = f"{workdir}/echo.bin"
    open(msgfile, "wb").write(MESSAGE)
    backend = spawn([MESHLESS, "backend", "--listen", f"127.0.0.1:{BACKEND}", "--name", "bench-backend"],
                    BACKEND, f"{workdir}/backend.log")
    results = {}
    try:
        for rep in range(REPEATS):
            for name in TARGETS:
                proc = start(name, workdir)
                try:
                    r = run(name, proc, backend, msgfile)
                finally:
                    stop(proc)
                results.setdefault(name, []).append(r)
                print(f"run {rep + 1}/{REPEATS} {name:8} {r}", file=sys.stderr, flush=True)
    finally:
        stop(backend)
    agg = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    for n, rs in results.items():
        agg[n]["failed"] = sum(r["failed"] for r in rs)
    print(f"\nUnary gRPC calls, h2load 4 connections x 32 streams, medians of {REPEATS} runs of "
          f"{DURATION} s; each proxy one worker thread; CPU per call is utime+stime over calls.\n")
    print("| target | calls/s | mean latency (ms) | proxy CPU µs/call | backend CPU µs/call | failed |")
    print("|---|---|---|---|---|---|")
    for n in TARGETS:
        a = agg[n]
        proxy = "-" if n == "direct" else fmt(a["proxy_us"])
        print(f"| {n} | {fmt(a['rps'], 0)} | {fmt(a['mean_ms'], 3)} | {proxy} | {fmt(a['backend_us'])} | {a['failed']} |")
    m, h, d = agg["meshless"], agg["haproxy"], agg["direct"]
    print(f"\n- proxy CPU per call, meshless / HAProxy: {fmt(m['proxy_us'] / h['proxy_us'], 2)}")
    print(f"- CPU per call through the proxy (proxy + backend) / direct (backend): "
          f"meshless {fmt((m['proxy_us'] + m['backend_us']) / d['backend_us'], 2)}, "
          f"HAProxy {fmt((h['proxy_us'] + h['backend_us']) / d['backend_us'], 2)}")
    print(f"- calls/s, meshless / HAProxy: {fmt(m['rps'] / h['rps'], 2)}; meshless / direct: {fmt(m['rps'] / d['rps'], 2)}")


if __name__ == "__main__":
    main()
