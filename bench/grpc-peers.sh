#!/usr/bin/env bash
# Unary gRPC calls on 127.0.0.1: direct to `meshless backend` (its echo
# service), through HAProxy (`mode http`, `proto h2` both sides) and through
# meshless (`upstream_protocol: http2`), each proxy with one worker thread.
# h2load sends the calls (POST of one length-prefixed EchoRequest,
# `content-type: application/grpc`, `te: trailers`). Prints a Markdown
# table of medians over REPEATS runs with CPU per call as ratios. Needs
# root (apt-get) on Debian; takes about 2 minutes.
#
#   bench/grpc-peers.sh
#   DURATION=3 REPEATS=1 bench/grpc-peers.sh   # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for tool in haproxy:haproxy h2load:nghttp2-client python3:python3 curl:curl; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
(service haproxy stop) >/dev/null 2>&1 || true

cargo build --release -q -p meshless
ulimit -n "$(ulimit -Hn)"

exec python3 bench/grpc_peers.py "$@"
