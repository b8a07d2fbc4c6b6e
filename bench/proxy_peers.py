#!/usr/bin/env python3
"""Driver of bench/proxy-peers.sh: starts each proxy, runs every scenario,
measures the proxy process, prints a Markdown table. Loopback only."""

import asyncio
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from peers_common import cpu_split, haproxy_http_conf, spawn, status_kb, tree, wait_port, stop

DURATION = int(os.environ.get("DURATION", "5"))
REPEATS = int(os.environ.get("REPEATS", "3"))
# 10,000 in the issue; this workplace caps open files at 20,000 per process
# and HAProxy reserves two per connection, so the default stays under that.
IDLE_CONNECTIONS = int(os.environ.get("IDLE_CONNECTIONS", "9000"))
# How many of them are opened (and make their first request) at once.
IDLE_AT_ONCE = int(os.environ.get("IDLE_AT_ONCE", "500"))
MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
# An older meshless binary to compare in the same run (target "baseline"),
# e.g. a release build of the commit before a change.
BASELINE = os.environ.get("BASELINE")

BACKEND = 18000
PORTS = {"direct": (18000, 18010), "haproxy": (18001, 18011), "nginx": (18002, 18012), "meshless": (18003, 18003),
         "baseline": (18005, 18005), "meshless_h1": (18007, 18007),
         "meshless_up": (18020, 18020)}

BACKEND_CONF = """
worker_processes 1; daemon off; pid {dir}/backend.pid; error_log {dir}/backend.err;
events {{ worker_connections 65000; }}
http {{
  access_log off; keepalive_requests 100000000; keepalive_timeout 300s;
  server {{ listen 127.0.0.1:18000; listen 127.0.0.1:18010 http2;
           location / {{ return 200 "hello from the backend\\n"; }} }}
}}
"""

HAPROXY_CONF = haproxy_http_conf(["127.0.0.1:18001", "127.0.0.1:18011 proto h2"], 18000)

NGINX_CONF = """
worker_processes 1; daemon off; pid {dir}/nginx.pid; error_log {dir}/nginx.err;
events {{ worker_connections 65000; }}
http {{
  access_log off; keepalive_requests 100000000; keepalive_timeout 300s;
  upstream be {{ server 127.0.0.1:18000; keepalive 512; keepalive_requests 100000000; }}
  server {{
    listen 127.0.0.1:18002; listen 127.0.0.1:18012 http2;
    location / {{ proxy_pass http://be; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
"""

MESHLESS_CONF = """
admin: { address: "127.0.0.1:ADMIN_PORT" }
access_log: "off"
listeners:
  - name: bench
    address: 127.0.0.1:LISTEN_PORT
    max_connections: 20000
    routes: [{ cluster: backend }]
clusters:
  - name: backend
    endpoints: [{ address: "127.0.0.1:18000" }]
    circuit_breakers: { max_connections: 100000, max_pending: 100000, max_requests: 100000 }
"""


def start(name, workdir):
    if name == "direct":
        return None
    if name == "haproxy":
        path = f"{workdir}/haproxy.cfg"
        open(path, "w").write(HAPROXY_CONF)
        cmd = ["haproxy", "-db", "-f", path]
    elif name == "nginx":
        path = f"{workdir}/nginx.conf"
        open(path, "w").write(NGINX_CONF.format(dir=workdir))
        cmd = ["nginx", "-c", path, "-p", workdir]
    else:
        path = f"{workdir}/{name}.yaml"
        conf = MESHLESS_CONF.replace("LISTEN_PORT", str(PORTS[name][0]))
        conf = conf.replace("ADMIN_PORT", str(PORTS[name][0] + 1))
        if BASELINE:
            # Older binaries may not know the field: the same config for both.
            conf = conf.replace("    max_connections: 20000\n", "")
        if name == "meshless_h1":
            # The same binary, HTTP/1 served by meshless's own state machine.
            conf = conf.replace("    routes:", "    http1: meshless\n    routes:")
        if name == "meshless_up":
            # The same binary, upstream HTTP/1.1 on meshless's own
            # connection (`clusters[].http1: meshless`) as well.
            conf = conf.replace("    routes:", "    http1: meshless\n    routes:")
            conf = conf.replace("    endpoints:", "    http1: meshless\n    endpoints:")
        open(path, "w").write(conf)
        binary = BASELINE if name == "baseline" else MESHLESS
        cmd = [binary, "proxy", "--threads", "1", "--config", path]
    return spawn(cmd, PORTS[name][0], f"{workdir}/{name}.log", timeout=10)


def wrk(port, connections, close=False):
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{DURATION}s", "--latency", f"http://127.0.0.1:{port}/"]
    if close:
        cmd[1:1] = ["-H", "Connection: close"]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = (int(errors.group(1)) if errors else 0) + (sum(map(int, sock.groups())) if sock else 0)

    def pct(p):
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
        return float(m.group(1)) * scale

    return requests, failed, pct(50), pct(99)


def h2load(port):
    n = 60000 * DURATION
    cmd = ["h2load", "-t1", "-c4", "-m32", f"-n{n}", f"http://127.0.0.1:{port}/"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    m = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded", out)
    done, ok = int(m.group(2)), int(m.group(3))
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean.group(2)]
    return ok, done - ok, float(mean.group(1)) * scale, float("nan")


async def hold_idle(port, count, hold_seconds, measure):
    """Opens `count` keep-alive connections, one request each, holds them idle."""
    conns = []
    sem = asyncio.Semaphore(IDLE_AT_ONCE)

    async def one():
        async with sem:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
            await w.drain()
            await r.readuntil(b"hello from the backend\n")
            conns.append(w)

    await asyncio.gather(*(one() for _ in range(count)))
    await asyncio.sleep(hold_seconds)
    value = measure()
    for w in conns:
        w.close()
    return value, len(conns)


def run_scenario(name, proc, scenario):
    port_h1, port_h2 = PORTS[name]
    pids = tree(proc.pid) if proc else []
    if scenario == "idle":
        before = status_kb(pids, "VmRSS")
        after, opened = asyncio.run(hold_idle(port_h1, IDLE_CONNECTIONS, 1.0, lambda: status_kb(pids, "VmRSS")))
        return {"bytes_per_conn": (after - before) * 1024 / max(opened, 1), "failed": IDLE_CONNECTIONS - opened}
    # Warm-up, not measured.
    subprocess.run(["wrk", "-t1", "-c32", "-d1s", f"http://127.0.0.1:{port_h1}/"], capture_output=True)
    user0, sys0 = cpu_split(pids)
    t0 = time.time()
    if scenario == "ka32":
        requests, failed, p50, p99 = wrk(port_h1, 32)
    elif scenario == "ka256":
        requests, failed, p50, p99 = wrk(port_h1, 256)
    elif scenario == "close":
        requests, failed, p50, p99 = wrk(port_h1, 32, close=True)
    else:
        requests, failed, p50, p99 = h2load(port_h2)
    elapsed = time.time() - t0
    user1, sys1 = cpu_split(pids)
    user, system = user1 - user0, sys1 - sys0
    return {
        "rps": requests / elapsed,
        "p50": p50,
        "p99": p99,
        "cpu_us": (user + system) * 1e6 / max(requests, 1) if proc else float("nan"),
        "user_us": user * 1e6 / max(requests, 1) if proc else float("nan"),
        "sys_us": system * 1e6 / max(requests, 1) if proc else float("nan"),
        "rss_mb": status_kb(pids, "VmHWM") / 1024 if proc else float("nan"),
        "failed": failed,
    }


SCENARIOS = [
    ("ka32", "HTTP/1.1 keep-alive, 32 connections"),
    ("ka256", "HTTP/1.1 keep-alive, 256 connections"),
    ("close", "HTTP/1.1, new connection per request (32 concurrent)"),
    ("h2", "HTTP/2, 4 connections x 32 streams"),
    ("idle", f"{IDLE_CONNECTIONS} idle keep-alive connections"),
]
# meshless_h1: the same binary with `listeners[].http1: meshless`;
# meshless_up: that, and `clusters[].http1: meshless` (not run unless named
# in PEERS: older binaries refuse the field).
TARGETS = ["direct", "haproxy", "nginx", "meshless", "meshless_h1"] + (["baseline"] if BASELINE else [])
# A subset, for a quick look: ONLY=idle,ka32 PEERS=haproxy,meshless.
if os.environ.get("ONLY"):
    SCENARIOS = [s for s in SCENARIOS if s[0] in os.environ["ONLY"].split(",")]
if os.environ.get("PEERS"):
    TARGETS = [t for t in TARGETS + ["meshless_up"] if t in os.environ["PEERS"].split(",")]


def med(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def fmt(v, digits=1):
    return "-" if v != v else f"{v:,.{digits}f}"


def main():
    workdir = tempfile.mkdtemp(prefix="meshless-bench-")
    open(f"{workdir}/backend.conf", "w").write(BACKEND_CONF.format(dir=workdir))
    backend = subprocess.Popen(["nginx", "-c", f"{workdir}/backend.conf", "-p", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    try:
        wait_port(BACKEND)
        for rep in range(REPEATS):
            for name in TARGETS:
                proc = start(name, workdir)
                try:
                    for scenario, _ in SCENARIOS:
                        if scenario == "idle" and name == "direct":
                            continue
                        r = run_scenario(name, proc, scenario)
                        results.setdefault((name, scenario), []).append(r)
                        print(f"run {rep + 1}/{REPEATS} {name:8} {scenario:5} {r}", file=sys.stderr, flush=True)
                finally:
                    stop(proc)
    finally:
        backend.send_signal(signal.SIGTERM)
        backend.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\nMedians of {REPEATS} runs of {DURATION} s; each proxy has one worker thread; "
          "CPU per request is the proxy process's utime+stime over requests served, "
          "also shown apart (user / system).\n")
    for scenario, title in SCENARIOS:
        print(f"### {title}\n")
        if scenario == "idle":
            print("| target | memory per idle connection (bytes) | failed |")
            print("|---|---|---|")
            rows = {}
            for name in [t for t in TARGETS if t != "direct"]:
                rs = results.get((name, scenario), [])
                rows[name] = med([r["bytes_per_conn"] for r in rs])
                print(f"| {name} | {fmt(rows[name], 0)} | {sum(r['failed'] for r in rs)} |")
            for mine in ("meshless", "meshless_h1", "meshless_up", "baseline"):
                if mine in rows and rows.get("haproxy"):
                    print(f"| {mine} / haproxy | {fmt(rows[mine] / rows['haproxy'], 2)} | |")
            print()
            continue
        latency = "mean latency (ms)" if scenario == "h2" else "p50 / p99 latency (ms)"
        print(f"| target | requests/s | {latency} | CPU µs per request | user / system µs | peak RSS (MiB) | failed |")
        print("|---|---|---|---|---|---|---|")
        agg = {}
        for name in TARGETS:
            rs = results.get((name, scenario), [])
            a = {k: med([r.get(k, float("nan")) for r in rs])
                 for k in ("rps", "p50", "p99", "cpu_us", "user_us", "sys_us", "rss_mb")}
            a["failed"] = sum(r["failed"] for r in rs)
            agg[name] = a
            lat = fmt(a["p50"], 3) if scenario == "h2" else f"{fmt(a['p50'], 3)} / {fmt(a['p99'], 3)}"
            split = f"{fmt(a['user_us'])} / {fmt(a['sys_us'])}"
            print(f"| {name} | {fmt(a['rps'], 0)} | {lat} | {fmt(a['cpu_us'])} | {split} | {fmt(a['rss_mb'])} | {a['failed']} |")
        for mine in ("meshless", "meshless_h1", "meshless_up", "baseline"):
            if mine not in agg or "haproxy" not in agg:
                continue
            m, h = agg[mine], agg["haproxy"]
            r = lambda k: fmt(m[k] / h[k], 2) if h[k] else "-"
            lat = r("p50") if scenario == "h2" else f"{r('p50')} / {r('p99')}"
            print(f"| {mine} / haproxy | {r('rps')} | {lat} | {r('cpu_us')} | {r('user_us')} / {r('sys_us')} | {r('rss_mb')} | |")
        print()


if __name__ == "__main__":
    main()
