#!/usr/bin/env python3
"""Bytes the proxy copies with `memcpy` per request, by size and by the
function that copies: where moves of large values (futures, requests,
closures) cost the proxy. Loopback only; needs root and `perf` with
uprobes.

Puts a uprobe on libc's `memcpy` (its length argument recorded), starts an
nginx backend and `meshless proxy --threads 1`, drives 32 keep-alive
connections with wrk, records every `memcpy` of the proxy for one second
with its callers (DWARF unwinding), and prints the bytes copied per
request, the calls per request, and the callers that copy the most. The
probe slows the proxy a hundredfold: only the counts per request matter.

  sudo python3 bench/copies.py                      # target/release/meshless
  MESHLESS=/tmp/meshless-old TOP=30 python3 bench/copies.py

Requests are counted in the same recording: the proxy makes two `writev`
calls per request in this load (the request upstream, the response
downstream). Which function copies depends on what the compiler inlined:
compare builds of one kind (two release builds, or two profile-guided
ones).
"""

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from peers_common import nginx_backend_conf, wait_port

MESHLESS = os.path.abspath(os.environ.get("MESHLESS", "target/release/meshless"))
TOP = int(os.environ.get("TOP", "20"))
LIBC = os.environ.get("LIBC", "/usr/lib/x86_64-linux-gnu/libc.so.6")
BACKEND, PROXY, ADMIN = 18200, 18203, 18204

MESHLESS_CONF = """
admin: {{ address: "127.0.0.1:{admin}" }}
access_log: "off"
listeners:
  - name: bench
    address: 127.0.0.1:{proxy}
    routes: [{{ cluster: backend }}]
clusters:
  - name: backend
    endpoints: [{{ address: "127.0.0.1:{backend}" }}]
"""


def memcpy_symbol():
    """The name of the `memcpy` this machine's libc runs (the one perf
    saw most in the proxy), else the generic one."""
    out = subprocess.run(["perf", "probe", "-x", LIBC, "-F", "__memmove*unaligned_erms"],
                         capture_output=True, text=True).stdout.split()
    for preferred in ("__memmove_avx512_unaligned_erms", "__memmove_avx_unaligned_erms"):
        if preferred in out:
            return preferred
    return out[0] if out else "memcpy"


def summarise(script):
    by_caller = collections.Counter()
    sizes = collections.defaultdict(collections.Counter)
    total = calls = writes = 0
    for block in script.split("\n\n"):
        lines = [l.strip() for l in block.strip().splitlines() if l.strip()]
        if lines and "sys_enter_writev" in lines[0]:
            writes += 1
            continue
        m = re.search(r"len=(\d+)", lines[0]) if lines else None
        if not m:
            continue
        n = int(m.group(1))
        frames = [re.sub(r"^[0-9a-f]+ ", "", l) for l in lines[1:]]
        frames = [f for f in frames if "memmove" not in f and "memcpy" not in f]
        caller = " <- ".join(f[:80] for f in frames[:2]) or "?"
        by_caller[caller] += n
        sizes[caller][n] += 1
        total += n
        calls += 1
    requests = max(writes / 2, 1)
    print(f"requests {requests:.0f} (writev / 2), bytes copied per request {total / requests:,.0f}, "
          f"memcpy calls per request {calls / requests:.1f}")
    print("bytes/request  [(size, calls/request)]  caller <- its caller")
    for caller, b in by_caller.most_common(TOP):
        top = [(n, round(c / requests, 1)) for n, c in sizes[caller].most_common(4)]
        print(f"{b / requests:8,.0f}  {top}  {caller[:170]}")


def main():
    if shutil.which("perf") is None or shutil.which("wrk") is None:
        sys.exit("needs perf and wrk")
    probe = f"meshless_copies={memcpy_symbol()} len=%dx:u64"
    added = subprocess.run(["perf", "probe", "-q", "-x", LIBC, "-a", probe], capture_output=True, text=True)
    if added.returncode != 0:
        sys.exit(f"perf probe failed (root and uprobes needed):\n{added.stderr}")
    workdir = tempfile.mkdtemp(prefix="meshless-copies-")
    open(f"{workdir}/backend.conf", "w").write(nginx_backend_conf(workdir, BACKEND))
    open(f"{workdir}/meshless.yaml", "w").write(
        MESHLESS_CONF.format(admin=ADMIN, proxy=PROXY, backend=BACKEND))
    backend = subprocess.Popen(["nginx", "-c", f"{workdir}/backend.conf", "-p", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proxy = None
    try:
        wait_port(BACKEND)
        proxy = subprocess.Popen([MESHLESS, "proxy", "--threads", "1", "--config", f"{workdir}/meshless.yaml"],
                                 stdout=subprocess.DEVNULL, stderr=open(f"{workdir}/proxy.log", "w"))
        wait_port(PROXY)
        url = f"http://127.0.0.1:{PROXY}/"
        subprocess.run(["wrk", "-t1", "-c32", "-d1s", url], capture_output=True)
        load = subprocess.Popen(["wrk", "-t1", "-c32", "-d4s", url], stdout=subprocess.DEVNULL)
        time.sleep(1)
        subprocess.run(["perf", "record", "-q", "-e", "probe_libc:meshless_copies",
                        "-e", "syscalls:sys_enter_writev", "--call-graph", "dwarf,4096",
                        "-p", str(proxy.pid), "-o", f"{workdir}/perf.data", "--", "sleep", "1"],
                       capture_output=True)
        load.wait()
        script = subprocess.run(["perf", "script", "-i", f"{workdir}/perf.data", "-F", "event,trace,ip,sym"],
                                capture_output=True, text=True).stdout
        print(MESHLESS)
        summarise(script)
    finally:
        if proxy:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait()
        backend.send_signal(signal.SIGTERM)
        backend.wait()
        subprocess.run(["perf", "probe", "-q", "-d", "probe_libc:meshless_copies"], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
