#!/usr/bin/env bash
# Profile-guided build of meshless (PGO): build an instrumented binary, run
# it as a proxy under a training load on 127.0.0.1, merge the profile, build
# again with it. The hot request path is laid out together and the code
# that never runs is moved aside: fewer instructions and far fewer
# instruction-cache misses per request (BENCHMARKS.md, "Profile-guided
# builds"). What runs in production is the same source, only optimised
# with the profile's counts.
#
#   deploy/pgo-build.sh                   # the production profile (fat LTO)
#   PROFILE=release deploy/pgo-build.sh   # quicker to build
#   OUT=/usr/local/bin/meshless deploy/pgo-build.sh
#   PROFDATA_OUT=/tmp/meshless.profdata deploy/pgo-build.sh   # keep the profile
#       (for builds of later changes with `RUSTFLAGS=-Cprofile-use=...`)
#
# The training load, through one `meshless proxy --threads 1` with its
# defaults (HTTP/1 served and sent by meshless's own codec) in front of a
# `meshless backend`: HTTP/1.1 keep-alive at 32 and 256 connections, a new
# connection per request, HTTP/2 (h2c, 4 connections x 32 streams), and
# HTTPS (HTTP/1.1 and h2 over TLS, a self-signed certificate made here).
# Paths it does not run (`http1: hyper`, `tcp` listeners, gRPC-web, the
# control plane) are built as cold code: correct, not tuned.
#
# Needs wrk, h2load and openssl (Debian: wrk, nghttp2-client, openssl) and
# rustup's llvm-tools (`rustup component add llvm-tools`, added here).
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE="${PROFILE:-production}"
TARGET="${CARGO_TARGET_DIR:-target}"
OUT="${OUT:-$TARGET/pgo/meshless}"
SECONDS_PER_LOAD="${SECONDS_PER_LOAD:-4}"
# Loopback ports of the training run; change them if these are taken.
BACKEND_PORT="${BACKEND_PORT:-18900}"
PROXY_PORT="${PROXY_PORT:-18901}"
TLS_PORT="${TLS_PORT:-18902}"
ADMIN_PORT="${ADMIN_PORT:-18903}"

for tool in wrk h2load openssl; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "pgo-build: $tool is needed for the training load (Debian: apt-get install wrk nghttp2-client openssl)" >&2
    exit 1
  }
done
rustup component add llvm-tools >/dev/null 2>&1 || true
sysroot="$(rustc --print sysroot)"
profdata="$(ls "$sysroot"/lib/rustlib/*/bin/llvm-profdata 2>/dev/null | head -n 1)"
if [[ -z $profdata ]]; then
  echo "pgo-build: llvm-profdata not found under $sysroot (rustup component add llvm-tools)" >&2
  exit 1
fi

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

echo "== 1/4 instrumented build ($PROFILE)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$work/profiles" CARGO_INCREMENTAL=0 \
  cargo build --profile "$PROFILE" --locked -p meshless --target-dir "$TARGET/pgo-generate"
trained="$TARGET/pgo-generate/$PROFILE/meshless"
# Build scripts ran instrumented too: only the proxy's profile is kept.
rm -rf "$work/profiles"

echo "== 2/4 training load"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost \
  -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
cat >"$work/proxy.yaml" <<EOF
admin: { address: "127.0.0.1:$ADMIN_PORT" }
access_log: "off"
listeners:
  - name: plain
    address: 127.0.0.1:$PROXY_PORT
    routes: [{ cluster: backend }]
  - name: tls
    address: 127.0.0.1:$TLS_PORT
    tls:
      default_certificate: { certificate: $work/cert.pem, key: $work/key.pem }
    routes: [{ cluster: backend }]
clusters:
  - name: backend
    endpoints: [{ address: "127.0.0.1:$BACKEND_PORT" }]
    circuit_breakers: { max_connections: 100000, max_pending: 100000, max_requests: 100000 }
EOF
wait_port() { # wait_port PORT: until something listens there (10 s at most)
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "pgo-build: nothing listens on 127.0.0.1:$1" >&2
  exit 1
}
LLVM_PROFILE_FILE="$work/discarded/backend-%p.profraw" \
  "$trained" backend --listen "127.0.0.1:$BACKEND_PORT" --name trainer >"$work/backend.log" 2>&1 &
pids+=($!)
LLVM_PROFILE_FILE="$work/profiles/proxy-%p.profraw" \
  "$trained" proxy --threads 1 --config "$work/proxy.yaml" >"$work/proxy.log" 2>&1 &
proxy=$!
pids+=("$proxy")
wait_port "$BACKEND_PORT"
wait_port "$PROXY_PORT"
wait_port "$TLS_PORT"
load() { # load NAME COMMAND...: one training load, its summary line printed
  echo "-- $1"
  shift
  "$@" 2>&1 | grep -E 'requests in|^requests:|Non-2xx|Socket errors' || true
}
d="${SECONDS_PER_LOAD}s"
n=$((20000 * SECONDS_PER_LOAD))
load "HTTP/1.1, 32 keep-alive connections" wrk -t1 -c32 -d"$d" "http://127.0.0.1:$PROXY_PORT/"
load "HTTP/1.1, 256 keep-alive connections" wrk -t1 -c256 -d"$d" "http://127.0.0.1:$PROXY_PORT/"
load "HTTP/1.1, a new connection per request" wrk -t1 -c32 -d"$d" -H "Connection: close" "http://127.0.0.1:$PROXY_PORT/"
load "HTTP/2 (h2c), 4 connections x 32 streams" h2load -t1 -c4 -m32 -n"$n" "http://127.0.0.1:$PROXY_PORT/"
load "HTTPS, HTTP/1.1, 32 keep-alive connections" wrk -t1 -c32 -d"$d" "https://localhost:$TLS_PORT/"
load "HTTPS, HTTP/2, 4 connections x 32 streams" h2load -t1 -c4 -m32 -n"$n" "https://localhost:$TLS_PORT/"
load "HTTPS, a new connection per request" wrk -t1 -c32 -d"$d" -H "Connection: close" "https://localhost:$TLS_PORT/"
# The profile is written when the proxy exits: a graceful stop.
kill -TERM "$proxy"
wait "$proxy" || {
  echo "pgo-build: the instrumented proxy did not exit cleanly; its log:" >&2
  cat "$work/proxy.log" >&2
  exit 1
}
if ! compgen -G "$work/profiles/*.profraw" >/dev/null; then
  echo "pgo-build: the instrumented proxy wrote no profile" >&2
  exit 1
fi

echo "== 3/4 merging the profile"
"$profdata" merge -o "$work/meshless.profdata" "$work/profiles"
if [[ -n ${PROFDATA_OUT:-} ]]; then
  cp "$work/meshless.profdata" "$PROFDATA_OUT"
fi

echo "== 4/4 optimised build ($PROFILE, with the profile)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$work/meshless.profdata" CARGO_INCREMENTAL=0 \
  cargo build --profile "$PROFILE" --locked -p meshless --target-dir "$TARGET/pgo-use"
mkdir -p "$(dirname "$OUT")"
cp "$TARGET/pgo-use/$PROFILE/meshless" "$OUT"
echo "pgo-build: $OUT"
