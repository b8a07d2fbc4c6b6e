#!/usr/bin/env python3
"""Code a proxy runs per request, in 64-byte instruction-cache lines, from
a callgrind dump made with `--dump-instr=yes`: how much of the
first-level instruction cache (32 KiB, 512 lines here) each request needs.
A request whose code does not fit misses it on every request whatever
the instruction count.

  KEEP=/tmp/cg VALGRIND_ARGS=--dump-instr=yes SCENARIOS=ka32 N=10000 \\
      python3 bench/callgrind.py
  python3 bench/code_footprint.py /tmp/cg/callgrind.ka32.out 10000

For each 64-byte line of code, the times its most run instruction ran
over the dump, divided by the requests N (the dump must hold N requests,
as callgrind.py's does): a line run at least once per request is "every
request"; the estimate of lines touched per request counts each line as
min(1, runs per request). Printed per object file (the binary, libc, the
vDSO), with the lines by function with TOP=n.
"""

import collections
import os
import re
import sys

TOP = int(os.environ.get("TOP", "0"))
LINE = 64


def parse(path):
    """Self executions per instruction address: {(object, address): runs},
    and the function of each address."""
    runs = collections.Counter()
    function_of = {}
    names = {"ob": {}, "fn": {}, "cfn": {}, "cob": {}, "fl": {}, "fi": {}, "fe": {}, "cfi": {}, "cfl": {}}
    ob = fn = None
    prev_addr = 0
    skip_next = False
    positions = 1
    spec = re.compile(r"^(ob|fn|fl|fi|fe|cob|cfn|cfi|cfl)=\((\d+)\)(?: (.*))?$")
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not line:
                continue
            if line.startswith("positions:"):
                positions = len(line.split()[1:])
                continue
            m = spec.match(line)
            if m:
                kind, ident, name = m.groups()
                table = names["fn" if kind == "cfn" else "ob" if kind == "cob" else kind]
                if name is not None:
                    table[ident] = name
                if kind == "ob":
                    ob = table.get(ident, ident)
                elif kind == "fn":
                    fn = table.get(ident, ident)
                continue
            if line.startswith("calls="):
                skip_next = True
                continue
            first = line[0]
            if not (first.isdigit() or first in "+-*"):
                continue
            fields = line.split()
            pos = fields[0]
            if pos == "*":
                addr = prev_addr
            elif pos[0] in "+-":
                addr = prev_addr + int(pos, 0)
            else:
                addr = int(pos, 0)
            prev_addr = addr
            if skip_next:
                # The inclusive cost of a call: not this instruction's own.
                skip_next = False
                continue
            costs = fields[positions:]
            if not costs:
                continue
            ir = int(costs[0])
            key = (ob, addr)
            runs[key] += ir
            function_of.setdefault(key, fn)
    return runs, function_of


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: code_footprint.py CALLGRIND_DUMP REQUESTS")
    path, requests = sys.argv[1], int(sys.argv[2])
    runs, function_of = parse(path)
    lines = collections.defaultdict(int)
    line_fn = {}
    for (ob, addr), n in runs.items():
        key = (ob, addr // LINE)
        if n > lines[key]:
            lines[key] = n
            line_fn[key] = function_of[(ob, addr)]
    by_object = collections.defaultdict(lambda: [0, 0.0])
    by_fn = collections.defaultdict(lambda: [0, 0.0])
    for key, n in lines.items():
        per = n / requests
        every = per >= 1.0
        by_object[key[0]][0] += every
        by_object[key[0]][1] += min(1.0, per)
        by_fn[line_fn[key]][0] += every
        by_fn[line_fn[key]][1] += min(1.0, per)
    total_every = sum(v[0] for v in by_object.values())
    total_est = sum(v[1] for v in by_object.values())
    print(f"{path}: {requests} requests")
    print(f"  lines run on every request: {total_every:,} ({total_every * LINE / 1024:.1f} KiB)")
    print(f"  lines touched per request (estimate): {total_est:,.0f} ({total_est * LINE / 1024:.1f} KiB)")
    for ob, (every, est) in sorted(by_object.items(), key=lambda kv: -kv[1][1]):
        if est >= 1:
            print(f"    {est:8,.0f} lines  {every:6,} every request  {os.path.basename(str(ob))}")
    if TOP:
        print(f"  functions by lines touched per request (top {TOP}):")
        for fn, (every, est) in sorted(by_fn.items(), key=lambda kv: -kv[1][1])[:TOP]:
            print(f"    {est:8,.1f}  {str(fn)[:150]}")


if __name__ == "__main__":
    main()
