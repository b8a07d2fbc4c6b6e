"""4,000 idle keep-alive connections on one proxy of bench/proxy_peers.py
(TARGET, default meshless_h1), opened N at a time for each N given: RSS
per connection, and how many upstream connections the proxy keeps after
the burst. MAX_IDLE sets the cluster's max_idle_per_endpoint.

  MESHLESS=<binary> [MAX_IDLE=32] python3 bench/idle_burst.py 32 500
"""
import asyncio, os, subprocess, sys, tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("MESHLESS", "target/release/meshless")
import proxy_peers as pp

def upstream_conns():
    out = subprocess.run(["ss", "-tnH", "state", "established", "( dport = :18000 )"], capture_output=True, text=True).stdout
    return len([l for l in out.splitlines() if l.strip()])

if os.environ.get("MAX_IDLE"):
    pp.MESHLESS_CONF = pp.MESHLESS_CONF.replace("    circuit_breakers:", "    connection_pool: { max_idle_per_endpoint: %s }\n    circuit_breakers:" % os.environ["MAX_IDLE"])
workdir = tempfile.mkdtemp(prefix="meshless-idle-")
open(f"{workdir}/backend.conf", "w").write(pp.BACKEND_CONF.format(dir=workdir))
backend = subprocess.Popen(["nginx", "-c", f"{workdir}/backend.conf", "-p", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    pp.wait_port(pp.BACKEND)
    for at_once in [int(x) for x in sys.argv[1:]]:
        pp.IDLE_AT_ONCE = at_once
        proc = pp.start(os.environ.get("TARGET", "meshless_h1"), workdir)
        try:
            pids = pp.tree(proc.pid)
            before = pp.status_kb(pids, "VmRSS")
            seen = {}
            def measure():
                seen["up"] = upstream_conns()
                return pp.status_kb(pids, "VmRSS")
            after, opened = asyncio.run(pp.hold_idle(pp.PORTS[os.environ.get("TARGET", "meshless_h1")][0], 4000, 1.0, measure))
            print(f"at_once {at_once}: {(after - before) * 1024 / opened:.0f} B per connection, upstream connections kept {seen['up']}", flush=True)
        finally:
            pp.stop(proc)
finally:
    backend.terminate()
