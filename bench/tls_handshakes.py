#!/usr/bin/env python3
"""TLS handshakes per second: meshless, HAProxy and nginx terminating TLS
with the same certificate (ECDSA P-256, made here with openssl), each in
front of the same `meshless backend`, one worker thread each. The load is
PARALLEL `openssl s_time -www /` clients, each connection a new TCP
connection, a TLS handshake and one HTTP/1.0 request: `-new` makes every
handshake a full one (no resumption), `-reuse` resumes the first
session. The proxy's CPU time per handshake comes from /proc. Loopback
only.

Usage: python3 bench/tls_handshakes.py   (after cargo build --release -p meshless)
Env: DURATION seconds per run (10), PARALLEL clients (4), REPEATS (3),
MESHLESS (target/release/meshless)."""

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from peers_common import cpu_seconds, spawn, tree, wait_port

DURATION = int(os.environ.get("DURATION", "10"))
PARALLEL = int(os.environ.get("PARALLEL", "4"))
REPEATS = int(os.environ.get("REPEATS", "3"))
MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
BASE = int(os.environ.get("BASE_PORT", "28200"))
BACKEND = BASE
PORTS = {"meshless": BASE + 1, "haproxy": BASE + 2, "nginx": BASE + 3}
ADMIN = BASE + 91

MESHLESS_CONF = """admin: {{ address: "127.0.0.1:{admin}" }}
listeners:
  - name: web
    address: "127.0.0.1:{port}"
    routes: [ {{ cluster: b }} ]
    tls:
      default_certificate: {{ certificate: "{dir}/cert.pem", key: "{dir}/key.pem" }}
clusters:
  - name: b
    endpoints: [ {{ address: "127.0.0.1:{backend}" }} ]
"""

HAPROXY_CONF = """global
  nbthread 1
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend fe
  bind 127.0.0.1:{port} ssl crt {dir}/combined.pem alpn h2,http/1.1 ssl-min-ver TLSv1.2
  default_backend be
backend be
  http-reuse always
  server s1 127.0.0.1:{backend}
"""

NGINX_CONF = """worker_processes 1; daemon off; pid {dir}/nginx.pid; error_log {dir}/nginx.err;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  upstream b {{ server 127.0.0.1:{backend}; keepalive 32; }}
  server {{ listen 127.0.0.1:{port} ssl http2;
    ssl_certificate {dir}/cert.pem; ssl_certificate_key {dir}/key.pem;
    ssl_protocols TLSv1.2 TLSv1.3;
    location / {{ proxy_pass http://b; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}
}}
"""


def make_cert(d):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", f"{d}/key.pem", "-out", f"{d}/cert.pem", "-days", "30",
                    "-subj", "/CN=bench.test", "-addext", "subjectAltName=DNS:bench.test"],
                   check=True, capture_output=True)
    with open(f"{d}/combined.pem", "w") as f:
        f.write(open(f"{d}/cert.pem").read() + open(f"{d}/key.pem").read())


def start(name, d):
    fmt = dict(dir=d, port=PORTS[name], backend=BACKEND, admin=ADMIN)
    if name == "meshless":
        conf = f"{d}/meshless.yaml"
        open(conf, "w").write(MESHLESS_CONF.format(**fmt))
        args = [MESHLESS, "proxy", "--config", conf, "--threads", "1"]
    elif name == "haproxy":
        conf = f"{d}/haproxy.cfg"
        open(conf, "w").write(HAPROXY_CONF.format(**fmt))
        args = ["haproxy", "-f", conf]
    else:
        conf = f"{d}/nginx.conf"
        open(conf, "w").write(NGINX_CONF.format(**fmt))
        args = ["nginx", "-c", conf, "-p", d]
    return spawn(args, PORTS[name], f"{d}/{name}.log", timeout=10)


def s_time(port, mode):
    """PARALLEL `openssl s_time -MODE` clients for DURATION seconds: the
    connections they completed, in total."""
    cmd = ["openssl", "s_time", "-connect", f"127.0.0.1:{port}", f"-{mode}",
           "-time", str(DURATION), "-www", "/"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(PARALLEL)]
    total = 0
    for p in procs:
        out, _ = p.communicate()
        m = re.search(r"(\d+) connections in [\d.]+s;", out)
        total += int(m.group(1)) if m else 0
    return total


def meshless_handshakes():
    text = urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/metrics").read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'meshless_proxy_tls_handshakes_total\{listener="web",result="(\w+)"\} ([\d.]+)', text)}


def main():
    if not os.path.exists(MESHLESS):
        sys.exit(f"{MESHLESS} missing: cargo build --release -p meshless")
    d = tempfile.mkdtemp(prefix="meshless-tls-")
    make_cert(d)
    backend = subprocess.Popen([MESHLESS, "backend", "--listen", f"127.0.0.1:{BACKEND}"], stderr=subprocess.DEVNULL)
    wait_port(BACKEND)
    results = {}
    try:
        for name in ("meshless", "haproxy", "nginx"):
            proc = start(name, d)
            pids = tree(proc.pid)
            try:
                s_time(PORTS[name], "new")  # warm-up
                for mode in ("new", "reuse"):
                    runs = []
                    for _ in range(REPEATS):
                        cpu0 = cpu_seconds(pids)
                        done = s_time(PORTS[name], mode)
                        cpu = cpu_seconds(pids) - cpu0
                        runs.append((done / DURATION, cpu * 1e6 / max(done, 1)))
                    results[(name, mode)] = runs
                if name == "meshless":
                    results["meshless_handshakes"] = meshless_handshakes()
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    finally:
        backend.send_signal(signal.SIGTERM)
        backend.wait()
    print(f"{PARALLEL} x openssl s_time -new|-reuse -time {DURATION} -www /; ECDSA P-256; median of {REPEATS}\n")
    print("| proxy | handshakes | per second (median) | runs | proxy CPU µs per handshake (median) |")
    print("|---|---|---|---|---|")
    for (name, mode), runs in ((k, v) for k, v in results.items() if isinstance(k, tuple)):
        rates = [r[0] for r in runs]
        cpu = statistics.median(r[1] for r in runs)
        kind = "full" if mode == "new" else "resumed"
        print(f"| {name} | {kind} | {statistics.median(rates):.0f} | {', '.join(f'{r:.0f}' for r in rates)} | {cpu:.0f} |")
    print(f"\nmeshless handshakes by result: {results.get('meshless_handshakes')}")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
