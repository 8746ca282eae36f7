#!/usr/bin/env bash
# A transformers model of Llama-3-8B's shape (bf16, random weights) on a node that never saw it,
# from a registry on the same machine, side by side in one run:
#   - what a user does instead: the model's safetensors kept in the registry as an OCI artifact
#     (one layer per file), fetched onto the node (bench/llama_files.py fetch: 64 MiB ranges
#     over 16 connections, no digest check), then a new Python process that imports
#     transformers, from_pretrained()s them onto the GPU and generate()s 16 tokens; and the
#     same load from the node's disk without the fetch (the page cache warm);
#   - gpusnap: the same model class captured once ready with the memory tier
#     (tests/llama_tier.py under `gpusnap run`), pushed to the same registry, then
#     `gpusnap restore oci://` into an empty node cache and run folder, timed to the copy's
#     first generated tokens (CHECK: generate() again, token for token against the answer
#     computed before the capture).
#
#   bench/run gpu-llama-fresh-node OUTDIR [LAYERS]
#
# LAYERS: 32 (default) is Llama-3-8B's depth, ~16 GB of weights. ROUNDS (default 2): rounds of
# each timed path. BIN: gpusnap, libgpusnap-tier.so, gpusnap-tier-prefill, tests/llama_tier.py
# (default build). REGISTRY: the docker-registry binary (default on PATH). STORE: a tmpfs for
# the model's files, the artifact and node copies (default /mnt/gpusnap-store, mounted when it
# is not a mount). REGDIR: the registry's storage (default /var/tmp/gpusnap-llama-registry).
# Results: OUTDIR/run.log (written as it goes) and every command's JSON.
set -uo pipefail
OUT=${1:?OUTDIR}; LAYERS=${2:-32}
BIN=${BIN:-build}; G=$(readlink -f "$BIN/gpusnap")
WORKLOAD=$(readlink -f "$BIN/tests/llama_tier.py")
HERE=$(dirname "$(readlink -f "$0")")
FILES=(python3 "$HERE/llama_files.py")
REGISTRY=${REGISTRY:-$(command -v docker-registry)}
STORE=${STORE:-/mnt/gpusnap-store}
REGDIR=${REGDIR:-/var/tmp/gpusnap-llama-registry}
ROUNDS=${ROUNDS:-2}
HOST=127.0.0.1:5125
mkdir -p "$OUT" "$STORE" "$REGDIR"
OUT=$(readlink -f "$OUT")
exec > >(tee -a "$OUT/run.log") 2>&1
mountpoint -q "$STORE" || mount -t tmpfs -o size=80g gpusnap-store "$STORE"
W=$STORE/llama-fresh-node
rm -rf "$W"; mkdir -p "$W"
# shellcheck source=bench/gpu_registry_lib.sh
source "$(dirname "$(readlink -f "$0")")/gpu_registry_lib.sh"
say() { echo "== $(date -u +%T) $*"; }

printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s/storage\nhttp:\n  addr: %s\n' "$REGDIR" "$HOST" >"$REGDIR/config.yml"
"$REGISTRY" serve "$REGDIR/config.yml" >"$OUT/registry.log" 2>&1 &
# shellcheck disable=SC2034  # REGPID is read by cleanup (gpu_registry_lib.sh)
REGPID=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/5125) 2>/dev/null && break; sleep 0.1; done

# Set-up, untimed: the model's files made and stored in the registry, then gone from the node.
say "making the model's safetensors ($LAYERS layers)"
timeout 300 "${FILES[@]}" make "$W/model" --layers "$LAYERS" || { say "make failed"; exit 1; }
timeout 300 "${FILES[@]}" push "$HOST" bench/llama-files a "$W/model" || { say "push failed"; exit 1; }
rm -rf "$W/model"

# What a user does on a fresh node.
for round in $(seq "$ROUNDS"); do
  gpu_idle
  rm -rf "$W/fetched"
  t=$(now)
  read -r bytes fetch_s < <(timeout 300 "${FILES[@]}" fetch "$HOST" bench/llama-files a "$W/fetched")
  load=$(timeout 300 "${FILES[@]}" load "$W/fetched" 2>"$OUT/load-$round.err")
  say "baseline $round: fetch $bytes bytes in $fetch_s s, then from_pretrained + generate: $load; tokens $(el "$t") s after the fetch began"
  [[ -n $load ]] || tail -5 "$OUT/load-$round.err"
done
gpu_idle
load=$(timeout 300 "${FILES[@]}" load "$W/fetched" 2>"$OUT/load-local.err")
say "baseline from the node's disk, page cache warm (no fetch): $load"
rm -rf "$W/fetched"

# gpusnap: captured once ready, pushed, restored into an empty node.
say "capturing tests/llama_tier.py ($LAYERS layers) with the memory tier"
t=$(now)
timeout 400 "$G" run -o "$W/art" --json -- python3 "$WORKLOAD" --tier --layers "$LAYERS" \
  --ready-file "$W/art.port" >"$OUT/capture.json" 2>"$OUT/capture.err"
say "capture: rc=$? $(el "$t") s"
t=$(now)
timeout 300 "$G" push "$W/art" "oci://$HOST/bench/llama-snap:a" --plain-http --json \
  >"$OUT/push.json" 2>"$OUT/push.err"
say "push: rc=$? $(el "$t") s"
rm -rf "$W/art"
for round in $(seq "$ROUNDS"); do
  gpu_idle
  rm -rf "$W/run" "$W/cache"
  t=$(now)
  timeout 300 "$G" restore "oci://$HOST/bench/llama-snap:a" --plain-http --cache "$W/cache" \
    --run-dir "$W/run" --publish "$(cat "$W/art.port")" --json \
    >"$OUT/restore-$round.json" 2>"$OUT/restore-$round.err"
  rc=$? cmd=$(el "$t")
  answer=$(ask "$(host_port "$OUT/restore-$round.json")" CHECK)
  say "gpusnap $round: restore oci:// rc=$rc, command $cmd s, first generated tokens $(el "$t") s: $answer"
  init=$(field "$OUT/restore-$round.json" "['copies'][0]['init_pid']")
  [[ -n $init ]] && kill -9 "$init" 2>/dev/null
  sleep 1
done
rm -rf "$W/run" "$W/cache"
say "done"
