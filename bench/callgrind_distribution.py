#!/usr/bin/env python3
"""Instructions per subscriber-message of the control plane's fan-out,
counted by callgrind: stable on a noisy machine where CPU time is not.
Loopback only.

Runs `meshless bench distribution` twice with its control plane under
`valgrind --tool=callgrind` (through MESHLESS_BENCH_PLANE_WRAPPER): once
with no single change, once with CHANGES of them; both runs have the same
setup and rolling update, so the difference in instructions over the
difference in messages sent is the cost of one message to one subscriber,
the write that caused it included (shared by the subscribers).

  python3 bench/callgrind_distribution.py
  SUBSCRIBERS=200 ENDPOINTS=200 CHANGES=50 python3 bench/callgrind_distribution.py
  MESHLESS=/tmp/meshless-old TOP=25 python3 bench/callgrind_distribution.py
  EXTRA="--subset-size 20" python3 bench/callgrind_distribution.py
  REPEATS=5 python3 bench/callgrind_distribution.py   # the median of 5 pairs

The count moves by up to ~20% between pairs (how many deltas a write
joins, heartbeats falling in the run): compare medians of several.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

from callgrind import totals

MESHLESS = os.environ.get("MESHLESS", "target/release/meshless")
SUBSCRIBERS = int(os.environ.get("SUBSCRIBERS", "200"))
ENDPOINTS = int(os.environ.get("ENDPOINTS", "200"))
CHANGES = int(os.environ.get("CHANGES", "50"))
TOP = int(os.environ.get("TOP", "0"))
REPEATS = int(os.environ.get("REPEATS", "1"))
EXTRA = os.environ.get("EXTRA", "").split()


def run(workdir, changes):
    """One bench run: (instructions of the plane, its JSON report, dump)."""
    out = f"{workdir}/plane.{changes}.cg"
    env = dict(os.environ)
    env["MESHLESS_BENCH_PLANE_WRAPPER"] = (
        f"valgrind --tool=callgrind --callgrind-out-file={out}")
    cmd = [MESHLESS, "bench", "distribution", "--subscribers", str(SUBSCRIBERS),
           "--endpoints", str(ENDPOINTS), "--changes", str(changes),
           "--json"] + EXTRA
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    return totals(out)["Ir"], report, out


def pair(workdir):
    """Instructions per subscriber-message of one pair of runs."""
    base_ir, base, _ = run(workdir, 0)
    ir, report, dump = run(workdir, CHANGES)
    messages = report["messages"] - base["messages"]
    if messages <= 0:
        sys.exit(f"no extra messages ({report['messages']} vs {base['messages']})")
    per = (ir - base_ir) / messages
    print(f"subscribers {SUBSCRIBERS}, endpoints {ENDPOINTS}, changes {CHANGES}: "
          f"{ir - base_ir:,} instructions for {messages:,} messages: "
          f"{per:,.0f} per subscriber-message "
          f"({report['messages_per_write']:.2f} messages per write)", flush=True)
    return per, dump


def main():
    workdir = tempfile.mkdtemp(prefix="meshless-cg-dist-")
    runs = [pair(workdir) for _ in range(REPEATS)]
    pers = sorted(per for per, _ in runs)
    median = pers[len(pers) // 2]
    if REPEATS > 1:
        print(f"median of {REPEATS}: {median:,.0f} per subscriber-message "
              f"(all: {', '.join(f'{p:,.0f}' for p in pers)})")
    if TOP:
        out = subprocess.run(["callgrind_annotate", "--threshold=100", runs[-1][1]],
                             capture_output=True, text=True).stdout
        rows = [l for l in out.splitlines() if re.match(r"^\s*[\d,]+ \(", l)]
        for l in rows[1:TOP + 1]:
            print("   ", l.strip()[:160])
    print(json.dumps({"subscribers": SUBSCRIBERS, "endpoints": ENDPOINTS,
                      "changes": CHANGES, "repeats": REPEATS,
                      "instructions_per_message": median,
                      "all": pers, "workdir": workdir}))


if __name__ == "__main__":
    main()
