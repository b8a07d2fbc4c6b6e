#!/usr/bin/env python3
"""Instructions per request of the proxy, counted by callgrind: stable on a
noisy machine where CPU time is not. Loopback only.

Starts an nginx backend and `meshless proxy --threads 1` under
`valgrind --tool=callgrind`, warms up, zeroes the counters, serves N
requests per scenario, dumps, and prints instructions (Ir) per request.
The counts cover every thread of the process (runtime, access log).

  python3 bench/callgrind.py                       # all scenarios
  SCENARIOS=ka32 N=20000 python3 bench/callgrind.py
  MESHLESS=/tmp/meshless-old TOP=25 python3 bench/callgrind.py
  MESHLESS=/tmp/meshless-67d1ef3 OLD=1 python3 bench/callgrind.py  # a binary older
                                   # than `listeners[].max_connections`
  KEEP=/tmp/cg python3 bench/callgrind.py          # keep the dumps there
  HTTP1=meshless python3 bench/callgrind.py        # listeners[].http1: meshless
  UPSTREAM_HTTP1=meshless python3 bench/callgrind.py   # clusters[].http1: meshless
  CACHE_SIM=1 SCENARIOS=ka256 python3 bench/callgrind.py  # also L1/LL misses
  PEER=haproxy python3 bench/callgrind.py          # HAProxy (`nbthread 1`) in
                                   # the proxy's place, as the bar to compare with

Scenarios: ka32 and ka256 (HTTP/1.1 keep-alive, 32 or 256 connections,
`h2load --h1`; ka256 runs when asked: SCENARIOS=ka256),
close (a new connection per request, 32 at once), h2 (4 connections x 32
streams). With TOP=n, the n costliest functions (self cost) of each
scenario are printed from `callgrind_annotate`. With CACHE_SIM=1,
callgrind simulates the caches (the host's sizes) and the data-cache misses
per request are printed too: I1mr instruction-cache misses, D1mr/D1mw
first-level read/write misses,
DLmr/DLmw last-level ones. Memory touched per request shows there when
instructions do not move.
"""

import asyncio
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from peers_common import haproxy_http_conf, nginx_backend_conf, wait_port

N = int(os.environ.get("N", "20000"))
TOP = int(os.environ.get("TOP", "0"))
CACHE_SIM = os.environ.get("CACHE_SIM") == "1"
SCENARIOS = os.environ.get("SCENARIOS", "ka32,close,h2").split(",")
MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
# `listeners[].http1`: hyper (the default) or meshless.
HTTP1 = os.environ.get("HTTP1", "hyper")
# `clusters[].http1`: hyper (the default) or meshless; the field is only
# written when asked (older binaries refuse it).
UPSTREAM_HTTP1 = os.environ.get("UPSTREAM_HTTP1")
# Which proxy runs under callgrind: meshless, or haproxy as the bar.
PEER = os.environ.get("PEER", "meshless")
BACKEND, PROXY, ADMIN, BACKEND_H2 = 18100, 18103, 18104, 18110

MESHLESS_CONF = """
admin: {{ address: "127.0.0.1:{admin}" }}
access_log: "off"
listeners:
  - name: bench
    address: 127.0.0.1:{proxy}
    max_connections: 20000
    http1: {http1}
    routes: [{{ cluster: backend }}]
clusters:
  - name: backend
    endpoints: [{{ address: "127.0.0.1:{backend}" }}]
    circuit_breakers: {{ max_connections: 100000, max_pending: 100000, max_requests: 100000 }}
"""



def h2load(args, n):
    cmd = ["h2load", "-t1", f"-n{n}", *args, f"http://127.0.0.1:{PROXY}/"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200).stdout
    m = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out)
    if not m:
        sys.exit(f"h2load failed:\n{out}")
    return int(m.group(1))


async def close_each(n, concurrency=32):
    """`n` requests, each on a new connection closed by `Connection: close`."""
    ok = 0
    left = n

    async def worker():
        nonlocal ok, left
        while left > 0:
            left -= 1
            r, w = await asyncio.open_connection("127.0.0.1", PROXY)
            w.write(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            data = await r.read()
            w.close()
            ok += data.startswith(b"HTTP/1.1 200")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def load(scenario, n):
    if scenario == "ka32":
        return h2load(["--h1", "-c32"], n)
    if scenario == "ka256":
        return h2load(["--h1", "-c256"], n)
    if scenario == "h2":
        return h2load(["-c4", "-m32"], n)
    if scenario == "close":
        return asyncio.run(close_each(n))
    sys.exit(f"unknown scenario {scenario}")


def totals(path):
    """Every event's total in a callgrind dump, by event name (Ir first)."""
    events = []
    for line in open(path):
        if line.startswith("events:"):
            events = line.split()[1:]
        if line.startswith(("summary:", "totals:")):
            return dict(zip(events, (int(v) for v in line.split()[1:])))
    raise RuntimeError(f"no totals in {path}")


def measure(pid, workdir, scenario):
    # `close` is slow under valgrind (a connect per request): fewer requests.
    n = N if scenario != "close" else max(N // 5, 1000)
    load(scenario, max(n // 10, 500))
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    served = load(scenario, n)
    before = set(glob.glob(f"{workdir}/cg.out.*"))
    subprocess.run(["callgrind_control", "-d", scenario, str(pid)], check=True, capture_output=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        new = set(glob.glob(f"{workdir}/cg.out.*")) - before
        if new:
            break
        time.sleep(0.2)
    dump = max(new, key=os.path.getmtime)
    time.sleep(1)  # let the dump finish writing
    events = totals(dump)
    ir = events["Ir"]
    if os.environ.get("KEEP"):
        os.makedirs(os.environ["KEEP"], exist_ok=True)
        shutil.copy(dump, os.path.join(os.environ["KEEP"], f"callgrind.{scenario}.out"))
    misses = "".join(f"  {name} {events[name] / served:7,.1f}"
                     for name in ("I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw") if name in events)
    print(f"{scenario:6} {served:7} requests  {ir / served:10,.0f} Ir/request{misses}", flush=True)
    if TOP:
        out = subprocess.run(["callgrind_annotate", "--threshold=100", dump],
                             capture_output=True, text=True).stdout
        rows = [l for l in out.splitlines() if re.match(r"^\s*[\d,]+ \(", l)]
        for l in rows[1:TOP + 1]:
            print("   ", l.strip()[:160])
    return ir / served


def main():
    workdir = tempfile.mkdtemp(prefix="meshless-cg-")
    open(f"{workdir}/backend.conf", "w").write(nginx_backend_conf(workdir, BACKEND))
    conf = MESHLESS_CONF.format(admin=ADMIN, proxy=PROXY, backend=BACKEND, http1=HTTP1)
    if UPSTREAM_HTTP1:
        conf = conf.replace("  - name: backend\n",
                            f"  - name: backend\n    http1: {UPSTREAM_HTTP1}\n")
    if os.environ.get("OLD") == "1":
        conf = conf.replace("    max_connections: 20000\n", "")
        conf = conf.replace("    http1: hyper\n", "")
    open(f"{workdir}/meshless.yaml", "w").write(conf)
    if PEER == "haproxy":
        # As proxy_peers.py runs it; a clear-text bind takes HTTP/2 by its
        # preface.
        conf = haproxy_http_conf([f"127.0.0.1:{PROXY}"], BACKEND)
        open(f"{workdir}/haproxy.cfg", "w").write(conf)
        command = ["haproxy", "-db", "-f", f"{workdir}/haproxy.cfg"]
    elif PEER == "meshless":
        command = [MESHLESS, "proxy", "--threads", "1", "--config", f"{workdir}/meshless.yaml"]
    else:
        sys.exit(f"PEER must be meshless or haproxy, not {PEER!r}")
    backend = subprocess.Popen(["nginx", "-c", f"{workdir}/backend.conf", "-p", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proxy = None
    try:
        wait_port(BACKEND, 60)
        proxy = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/cg.out.%p",
             f"--cache-sim={'yes' if CACHE_SIM else 'no'}",
             *os.environ.get("VALGRIND_ARGS", "").split(), *command],
            stdout=subprocess.DEVNULL, stderr=open(f"{workdir}/valgrind.log", "w"))
        wait_port(PROXY, 60)
        print(command[0])
        for scenario in SCENARIOS:
            measure(proxy.pid, workdir, scenario)
    finally:
        if proxy:
            proxy.send_signal(signal.SIGKILL)
            proxy.wait()
        backend.send_signal(signal.SIGTERM)
        backend.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
