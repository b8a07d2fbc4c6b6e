#!/usr/bin/env bash
# Side-by-side proxy benchmark on 127.0.0.1: direct / HAProxy / nginx /
# meshless in front of one nginx backend, each proxy with one worker thread.
# Prints a Markdown table of medians over REPEATS runs, with meshless/HAProxy
# ratios. Needs root (apt-get) on Debian; takes about 10 minutes.
#
#   bench/proxy-peers.sh                 # everything
#   DURATION=3 REPEATS=1 bench/proxy-peers.sh   # a quick look
#   BASELINE=/tmp/meshless-old bench/proxy-peers.sh   # an older build beside, same run
#   ONLY=ka32,h2 PEERS=haproxy,meshless,baseline  # a subset of scenarios and targets
#   PROFILE=release bench/proxy-peers.sh  # the quicker build; default: production,
#                                         # what deploy/Dockerfile ships (fat LTO)
#   PGO=0 bench/proxy-peers.sh            # without the profile-guided build that
#                                         # deploy/Dockerfile ships (deploy/pgo-build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for tool in haproxy:haproxy nginx:nginx-light wrk:wrk h2load:nghttp2-client python3:python3 openssl:openssl; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Debian starts packaged services on install: stop them, they are not ours.
(service nginx stop; service haproxy stop) >/dev/null 2>&1 || true

PROFILE="${PROFILE:-production}"
if [[ -z ${MESHLESS:-} ]]; then
  if [[ ${PGO:-1} == 1 ]]; then
    # Two builds and a training run of about 30 s (deploy/pgo-build.sh).
    OUT="${CARGO_TARGET_DIR:-target}/pgo/meshless" PROFILE="$PROFILE" deploy/pgo-build.sh
    MESHLESS="${CARGO_TARGET_DIR:-target}/pgo/meshless"
  else
    cargo build --profile "$PROFILE" -q -p meshless
    MESHLESS="${CARGO_TARGET_DIR:-target}/$PROFILE/meshless"
  fi
fi
export MESHLESS
ulimit -n "$(ulimit -Hn)"

exec python3 bench/proxy_peers.py "$@"
