"""What the side-by-side benchmark scripts share: starting and stopping
the processes under test, waiting for their ports, and reading their CPU
time and memory from /proc. Loopback only. Imported by the scripts in
this folder (`python3 bench/NAME.py` puts this folder on the path)."""

import signal
import socket
import subprocess
import sys
import time
import os

TICKS = os.sysconf("SC_CLK_TCK")


def wait_port(port, timeout=10.0):
    """Returns once 127.0.0.1:`port` accepts a connection; raises
    RuntimeError after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def spawn(cmd, port, log_path, timeout=20.0):
    """Starts `cmd` with stderr to `log_path` and waits for `port`; exits
    the script with the log when it does not open."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    try:
        wait_port(port, timeout)
    except RuntimeError:
        proc.kill()
        sys.exit(f"{cmd[0]} did not start:\n" + open(log_path).read())
    return proc


def stop(proc):
    """SIGTERM, then SIGKILL after 15 s; `None` is nothing to stop."""
    if proc is None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tree(pid):
    """`pid` and all its descendants (nginx's master and workers)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [pid] + [p for c in out.split() for p in tree(int(c))]


def cpu_split(pids):
    """(user, system) CPU seconds of the processes (a pid or a list);
    processes already gone count 0."""
    if isinstance(pids, int):
        pids = [pids]
    user = system = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            user += int(fields[11])  # utime
            system += int(fields[12])  # stime
        except (FileNotFoundError, IndexError):
            pass
    return user / TICKS, system / TICKS


def cpu_seconds(pids):
    """User + system CPU seconds of the processes (a pid or a list);
    processes already gone count 0."""
    return sum(cpu_split(pids))


def status_kb(pids, key):
    """The sum of a /proc/PID/status field in kB (`VmRSS`, `VmHWM`)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total


NGINX_BACKEND_CONF = """
worker_processes 1; daemon off; pid {dir}/backend.pid; error_log {dir}/backend.err;
events {{ worker_connections 65000; }}
http {{
  access_log off; keepalive_requests 100000000; keepalive_timeout 300s;
  server {{ listen 127.0.0.1:{port}; location / {{ return 200 "hello from the backend\\n"; }} }}
}}
"""


def nginx_backend_conf(workdir, port):
    """An nginx backend (one worker, keep-alive without limit) answering
    every request on 127.0.0.1:`port` with a 23-byte body; its pid and
    error log in `workdir`."""
    return NGINX_BACKEND_CONF.format(dir=workdir, port=port)


def haproxy_http_conf(binds, backend):
    """HAProxy as the HTTP benchmarks run it (`nbthread 1`, connections to
    the backend reused): one `bind` line per entry of `binds` (an address,
    optionally followed by options such as `proto h2`), one server at
    127.0.0.1:`backend`. `maxconn` stays within a 20,000 file limit
    (HAProxy reserves two files per connection; valgrind's own limit too)."""
    bind_lines = "".join(f"  bind {b}\n" for b in binds)
    return f"""
global
  nbthread 1
  maxconn 9500
defaults
  mode http
  timeout connect 5s
  timeout client 300s
  timeout server 300s
  timeout http-keep-alive 300s
frontend fe
{bind_lines}  default_backend be
backend be
  http-reuse always
  server s1 127.0.0.1:{backend}
"""
