#!/usr/bin/env python3
"""Binary upgrade / reload under load: meshless (--upgrade-socket, then
--takeover), HAProxy (seamless reload: -x with `expose-fd listeners`, -sf)
and nginx (`nginx -s reload`), in one run, each in front of the same
`meshless backend`. HTTP/1.1 keep-alive clients (asyncio, no retries) send
requests throughout; a request is failed when its connection is refused,
reset or closed before its whole response. Long-lived TCP flows (each
FLOW_SECONDS of echoed messages) go through each proxy's TCP listener
(meshless `protocol: tcp`, HAProxy `mode tcp`, nginx `stream`) to an echo
server of this script; a flow is broken when it is reset, closed or an
echo differs before it ends. Loopback only.

Usage: python3 bench/upgrade_peers.py   (after cargo build --release -p meshless)
Env: RELOADS (20), CLIENTS (16), INTERVAL seconds between reloads (0.5),
FLOWS (8 concurrent TCP flows), FLOW_SECONDS (3),
MESHLESS (target/release/meshless)."""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from peers_common import wait_port

RELOADS = int(os.environ.get("RELOADS", "20"))
CLIENTS = int(os.environ.get("CLIENTS", "16"))
INTERVAL = float(os.environ.get("INTERVAL", "0.5"))
MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
BASE = int(os.environ.get("BASE_PORT", "28100"))
BACKEND = BASE
FLOWS = int(os.environ.get("FLOWS", "8"))
FLOW_SECONDS = float(os.environ.get("FLOW_SECONDS", "3"))
PORTS = {"meshless": BASE + 1, "haproxy": BASE + 2, "nginx": BASE + 3}
ECHO = BASE + 4
TCP_PORTS = {"meshless": BASE + 5, "haproxy": BASE + 6, "nginx": BASE + 7}
NGINX_STREAM = "/usr/lib/nginx/modules/ngx_stream_module.so"

MESHLESS_CONF = """admin: {{ address: "127.0.0.1:{admin}" }}
drain_timeout: 10s
listeners:
  - name: web
    address: "127.0.0.1:{port}"
    routes: [ {{ cluster: b }} ]
  - name: flows
    address: "127.0.0.1:{tcp_port}"
    protocol: tcp
    tcp: {{ cluster: echo, flow_key: source_ip_port }}
clusters:
  - name: b
    endpoints: [ {{ address: "127.0.0.1:{backend}" }} ]
  - name: echo
    balancer: {{ policy: maglev }}
    endpoints: [ {{ address: "127.0.0.1:{echo}" }} ]
"""

HAPROXY_CONF = """global
  stats socket {dir}/haproxy.sock mode 600 level admin expose-fd listeners
  nbthread 1
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend fe
  bind 127.0.0.1:{port}
  default_backend be
backend be
  server s1 127.0.0.1:{backend}
frontend fe_tcp
  mode tcp
  bind 127.0.0.1:{tcp_port}
  default_backend be_tcp
backend be_tcp
  mode tcp
  server e1 127.0.0.1:{echo}
"""

NGINX_CONF = """{load_stream}worker_processes 1; daemon on; pid {dir}/nginx.pid; error_log {dir}/nginx.err;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  upstream b {{ server 127.0.0.1:{backend}; keepalive 32; }}
  server {{ listen 127.0.0.1:{port};
    location / {{ proxy_pass http://b; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}
}}
{stream}"""
NGINX_STREAM_CONF = """stream {{ server {{ listen 127.0.0.1:{tcp_port}; proxy_pass 127.0.0.1:{echo}; }} }}
"""


class Stats:
    def __init__(self):
        self.ok = 0
        self.failed = 0
        self.refused = 0
        self.bad_status = 0
        self.closed_by_server = 0
        self.flows_ok = 0
        self.flows_broken = 0


async def echo(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    writer.close()


async def flow(port, stats, stop):
    """Long-lived TCP flows one after another: 64-byte messages every
    20 ms for FLOW_SECONDS, each echo checked, then a clean close."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            stats.refused += 1
            await asyncio.sleep(0.01)
            continue
        end, i = time.time() + FLOW_SECONDS, 0
        try:
            while time.time() < end:
                msg = f"flow message {i:08d} ".ljust(64, "x").encode()
                writer.write(msg)
                await writer.drain()
                if await reader.readexactly(len(msg)) != msg:
                    raise ValueError("echo differs")
                i += 1
                await asyncio.sleep(0.02)
            stats.flows_ok += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            stats.flows_broken += 1
        writer.close()


async def client(port, stats, stop):
    reader = writer = None
    while not stop.is_set():
        if writer is None:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                stats.refused += 1
                await asyncio.sleep(0.01)
                continue
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
            await reader.readexactly(int(headers.get("content-length", "0")))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            stats.failed += 1
            writer.close()
            writer = None
            continue
        if status == 200:
            stats.ok += 1
        else:
            stats.bad_status += 1
        if headers.get("connection", "").lower() == "close":
            stats.closed_by_server += 1
            writer.close()
            writer = None
    if writer is not None:
        writer.close()


class Meshless:
    def __init__(self, workdir):
        self.dir = workdir
        self.conf = os.path.join(workdir, "meshless.yaml")
        self.sock = os.path.join(workdir, "upgrade.sock")
        self.log = open(os.path.join(workdir, "meshless.log"), "w+")
        with open(self.conf, "w") as f:
            f.write(MESHLESS_CONF.format(port=PORTS["meshless"], backend=BACKEND, admin=BASE + 91,
                                         tcp_port=TCP_PORTS["meshless"], echo=ECHO))
        self.procs = []

    def _spawn(self, takeover):
        args = [MESHLESS, "proxy", "--config", self.conf, "--threads", "1", "--upgrade-socket", self.sock]
        if takeover:
            args.append("--takeover")
        self.procs.append(subprocess.Popen(args, stderr=self.log, stdout=subprocess.DEVNULL))

    def start(self):
        self._spawn(False)
        wait_port(PORTS["meshless"])

    def reload(self, n):
        self._spawn(True)
        end = time.time() + 20
        while self._count("took over the listening sockets") < n:
            if time.time() > end or self.procs[-1].poll() is not None:
                raise SystemExit("meshless: takeover did not complete; see " + self.log.name)
            time.sleep(0.02)

    def _count(self, text):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read().count(text)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.wait(timeout=30)


class HAProxy:
    def __init__(self, workdir):
        self.dir = workdir
        self.conf = os.path.join(workdir, "haproxy.cfg")
        self.pid = os.path.join(workdir, "haproxy.pid")
        with open(self.conf, "w") as f:
            f.write(HAPROXY_CONF.format(dir=workdir, port=PORTS["haproxy"], backend=BACKEND,
                                        tcp_port=TCP_PORTS["haproxy"], echo=ECHO))

    def start(self):
        subprocess.run(["haproxy", "-D", "-f", self.conf, "-p", self.pid], check=True)
        wait_port(PORTS["haproxy"])

    def reload(self, _n):
        old = open(self.pid).read().split()
        subprocess.run(["haproxy", "-D", "-f", self.conf, "-p", self.pid,
                        "-x", os.path.join(self.dir, "haproxy.sock"), "-sf", *old], check=True)

    def stop(self):
        for pid in open(self.pid).read().split():
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


class Nginx:
    def __init__(self, workdir):
        self.dir = workdir
        self.conf = os.path.join(workdir, "nginx.conf")
        with open(self.conf, "w") as f:
            stream = os.path.exists(NGINX_STREAM)
            f.write(NGINX_CONF.format(
                dir=workdir, port=PORTS["nginx"], backend=BACKEND,
                load_stream=f"load_module {NGINX_STREAM};\n" if stream else "",
                stream=NGINX_STREAM_CONF.format(tcp_port=TCP_PORTS["nginx"], echo=ECHO) if stream else ""))

    def start(self):
        subprocess.run(["nginx", "-c", self.conf, "-p", self.dir], check=True)
        wait_port(PORTS["nginx"])

    def reload(self, _n):
        subprocess.run(["nginx", "-c", self.conf, "-p", self.dir, "-s", "reload"], check=True)

    def stop(self):
        subprocess.run(["nginx", "-c", self.conf, "-p", self.dir, "-s", "quit"], check=False)
        time.sleep(0.5)


def has_flows(name):
    return name != "nginx" or os.path.exists(NGINX_STREAM)


async def measure(name, server):
    stats, stop = Stats(), asyncio.Event()
    echo_server = await asyncio.start_server(echo, "127.0.0.1", ECHO)
    tasks = [asyncio.create_task(client(PORTS[name], stats, stop)) for _ in range(CLIENTS)]
    if has_flows(name):
        tasks += [asyncio.create_task(flow(TCP_PORTS[name], stats, stop)) for _ in range(FLOWS)]
    await asyncio.sleep(1.0)
    start = time.time()
    for n in range(1, RELOADS + 1):
        await asyncio.to_thread(server.reload, n)
        await asyncio.sleep(INTERVAL)
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    echo_server.close()
    return stats, time.time() - start


def main():
    if not os.path.exists(MESHLESS):
        sys.exit(f"{MESHLESS} missing: cargo build --release -p meshless")
    for tool in ("haproxy", "nginx"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    workdir = tempfile.mkdtemp(prefix="meshless-upgrade-")
    backend = subprocess.Popen([MESHLESS, "backend", "--listen", f"127.0.0.1:{BACKEND}"],
                               stderr=subprocess.DEVNULL)
    wait_port(BACKEND)
    rows = []
    try:
        for name, kind in (("meshless", Meshless), ("haproxy", HAProxy), ("nginx", Nginx)):
            server = kind(workdir)
            server.start()
            try:
                stats, secs = asyncio.run(measure(name, server))
            finally:
                server.stop()
            rows.append((name, stats, secs))
    finally:
        backend.send_signal(signal.SIGTERM)
        backend.wait()
    print(f"{RELOADS} reloads, one every ~{INTERVAL}s, {CLIENTS} HTTP/1.1 keep-alive clients, "
          f"{FLOWS} concurrent TCP flows of {FLOW_SECONDS}s\n")
    print("| proxy | requests ok | failed (reset/closed mid-request) | refused | non-200 | closed politely (`connection: close`) | flows ok | flows broken | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s, secs in rows:
        flows = (s.flows_ok, s.flows_broken) if has_flows(name) else ("n/a", "n/a")
        print(f"| {name} | {s.ok} | {s.failed} | {s.refused} | {s.bad_status} | {s.closed_by_server} | {flows[0]} | {flows[1]} | {secs:.1f} |")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
