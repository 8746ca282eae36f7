#!/usr/bin/env bash
# A memory-tier snapshot restored on a node that never saw it, from a registry on the same
# machine, side by side in one run: what a restore does now (`gpusnap restore oci://`, the tier's
# prefill filling the GPU as the drain files arrive), the previous path (the same restore with
# the copy filling its tier itself once every byte is there: GPUSNAP_TIER_PREFILL=off), the pull
# alone and the restore of the pulled copy; and what a fresh start costs instead (the workload
# loading its weights from the local file, its own `wait-ready`). Each restore is timed to the
# copy's first exact answer (CHECK: the CUDA graph replayed, bit-exact) into an empty node cache
# and run folder. Then the same with the registry reading its disk, beside the disk's own read
# time for the registry's blobs (dd, O_DIRECT): the registry's files dropped from the page cache,
# then every cache dropped (BENCH_COLD_SCOPES, default "registry all"). And deduplication: a second
# capture of the same workload (same weights, same commands) pushed after the first, tier path
# and transparent path, its new bytes against the snapshot's, and a capture of a model that
# differs in 10 % of its weights (every tenth layer's low bit flipped, as a fine-tune would).
# With KEYS=DIR (sign.pem, a P-256 key; node.pem/node.pub, an X25519 pair; dedup.secret; each
# 0600) also the cost of trust: the same snapshot pushed signed and encrypted to repositories of
# their own, pulled and restored under a policy that wants the signature and with the node's
# decryption key, beside the same without.
#
#   bench/run gpu-tier-registry GIB OUTDIR
#
# BIN: gpusnap, libgpusnap-tier.so, gpusnap-tier-prefill and tests/torch_tier.py (default
# build). REGISTRY: the docker-registry binary (default on PATH; on the GPU machine carry
# /usr/bin/docker-registry: it needs only libc). STORE: a huge-page tmpfs for the artifacts and
# node copies (default /mnt/gpusnap-store, mounted when it is not a mount). REGDIR: the
# registry's storage on the local disk (default /var/tmp/gpusnap-tier-registry). BENCH_COLD=0
# leaves out the cold rounds, BENCH_DEDUP=0 the second captures. GPUSNAP_CRIU: CRIU.
# BENCH_ROUNDS: the warm rounds of streamed and previous restores (default 2); BENCH_COLD_ROUNDS
# the cold rounds of each scope (default 1; the previous path in the first alone); TRUST_ROUNDS
# those of the trust section (default 1); BENCH_DEDUP_PLAIN=0 leaves out the transparent path's
# second capture. BENCH_BUFFERED=1 adds to each round the streamed restore with the prefill
# copying through its pinned buffers instead of from the files' pages (GPUSNAP_TIER_IN_PLACE=0).
# Each restore's node cache is cache-NAME, removed after it (restore_check).
# Results: OUTDIR/run.log (written as it goes) and every command's JSON.
set -uo pipefail
GIB=${1:?GIB}; OUT=${2:?OUTDIR}
BIN=${BIN:-build}; G=$(readlink -f "$BIN/gpusnap")
WORKLOAD=$(readlink -f "$BIN/tests/torch_tier.py")
REGISTRY=${REGISTRY:-$(command -v docker-registry)}
STORE=${STORE:-/mnt/gpusnap-store}
REGDIR=${REGDIR:-/var/tmp/gpusnap-tier-registry}
COLD=${BENCH_COLD:-1}; DEDUP=${BENCH_DEDUP:-1}; ROUNDS=${BENCH_ROUNDS:-2}; KEYS=${KEYS:-}
BUFFERED=${BENCH_BUFFERED:-0}
mkdir -p "$OUT" "$STORE" "$REGDIR"
OUT=$(readlink -f "$OUT")
exec > >(tee -a "$OUT/run.log") 2>&1
mountpoint -q "$STORE" || mount -t tmpfs -o huge=within_size,size=$(( GIB * 4 + 16 ))g gpusnap-store "$STORE"
W=$STORE/tier-registry
rm -rf "$W"; mkdir -p "$W"
# shellcheck source=bench/gpu_registry_lib.sh
source "$(dirname "$(readlink -f "$0")")/gpu_registry_lib.sh"

printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s/storage\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:5124\n  secret: bench\n' "$REGDIR" >"$REGDIR/config.yml"
"$REGISTRY" serve "$REGDIR/config.yml" >"$OUT/registry.log" 2>&1 &
# shellcheck disable=SC2034  # REGPID is read by cleanup (gpu_registry_lib.sh)
REGPID=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/5124) 2>/dev/null && break; sleep 0.1; done

WEIGHTS=$W/weights.bin
capture() {  # NAME --tier|--no-tier: `gpusnap run` to READY, then its checkpoint
  local name=$1 flag=$2 t; t=$(now)
  timeout 400 "$G" run -o "$W/$name" --json -- python3 "$WORKLOAD" "$flag" --gib "$GIB" \
    --weights "$WEIGHTS" --ready-file "$W/$name.port" >"$OUT/$name-run.json" 2>"$OUT/$name-run.err"
  echo "== capture $name ($flag): rc=$? $(el "$t") s; $(phases "$OUT/$name-run.json")"
}
push() {  # NAME TAG [REPO [FLAGS...]]
  local name=$1 tag=$2 repo=${3:-tier}; shift 2; shift $(( $# > 0 ? 1 : 0 ))
  local t; t=$(now)
  timeout 400 "$G" push "$W/$name" "oci://127.0.0.1:5124/bench/$repo:$tag" --plain-http --json "$@" \
    >"$OUT/push-$repo-$tag.json" 2>"$OUT/push-$repo-$tag.err"
  local rc=$?
  echo "== push $name as $repo:$tag${*:+ ($*)}: rc=$rc $(el "$t") s; $(python3 - "$OUT/push-$repo-$tag.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"(no JSON: {e})"); sys.exit()
keys = ("chunks", "chunks_uploaded", "bytes", "bytes_uploaded", "stored_bytes")
print(", ".join(f"{k} {d[k]}" for k in d if isinstance(d[k], (int, float)) and not isinstance(d[k], bool)))
PY
)"
}
restore_check() {  # NAME EXPECTED-PORT-FILE ARTIFACT-OR-REF [FLAGS...]: one copy, timed to its first exact answer
  local name=$1 portfile=$2 what=$3; shift 3
  gpu_idle
  rm -rf "$W/run-$name" "$W/cache-$name"
  cpu_mark
  local t; t=$(now)
  timeout 300 "$G" restore "$what" --publish "$(cat "$portfile")" --json --run-dir "$W/run-$name" \
    "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
  local rc=$? cmd; cmd=$(el "$t")
  cpu_since; local cpu=$CPU_TEXT
  local answer; answer=$(ask "$(host_port "$OUT/$name.json")" CHECK)
  echo "== $name: rc=$rc, command $cmd s, first answer $(el "$t") s: $answer"
  echo "   phases: $(phases "$OUT/$name.json")"
  echo "   $cpu (the restore command and what it waited for)"
  [[ $answer == "OK max_err=0 "* ]] || { echo "== $name: NOT EXACT"; tail -5 "$OUT/$name.err"; }
  grep -h "tier prefill" "$OUT/$name.err" | head -2 | sed 's/^/   /'
  grep -o '"pulled [^"]*CPU[^"]*"' "$OUT/$name.json" | head -1 | sed 's/^/   /'
  local init; init=$(field "$OUT/$name.json" "['copies'][0]['init_pid']")
  [[ -n $init ]] && kill -9 "$init" 2>/dev/null
  sleep 1
  rm -rf "$W/run-$name" "$W/cache-$name"
}
pull_alone() {  # NAME [REF [FLAGS...]]: gpusnap pull into an empty node cache
  local name=$1 ref=${2:-$REF}; shift; shift $(( $# > 0 ? 1 : 0 ))
  rm -rf "$W/pulled-$name" "$W/cache-$name"
  cpu_mark
  local t; t=$(now)
  timeout 300 "$G" pull "$ref" -o "$W/pulled-$name" --plain-http --cache "$W/cache-$name" --json "$@" \
    >"$OUT/$name.json" 2>"$OUT/$name.err"
  local rc=$? took; took=$(el "$t")
  cpu_since; local cpu=$CPU_TEXT
  echo "== $name: rc=$rc $took s ($(du -sb --apparent-size "$W/pulled-$name" 2>/dev/null | cut -f1) bytes; $cpu)"
  echo "   gpusnap's threads: $(field "$OUT/$name.json" "['cpu_seconds']") (CPU seconds fetching, decoding, writing)"
}
# The weights file first (the workload makes it when missing), untimed.
capture warm --no-tier >/dev/null; rm -rf "$W/warm"
capture tier-a --tier
echo "== a fresh start instead (the workload loading its weights and capturing its graph): wait-ready $(python3 - "$OUT/tier-a-run.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(next((p["seconds"] for p in d.get("phases", []) if p["name"] == "wait-ready"), "?"))
PY
) s"
push tier-a a
REF=oci://127.0.0.1:5124/bench/tier:a
echo "== registry's page cache warm (the blobs were just written)"
pull_alone pull-warm
restore_check restore-pulled "$W/tier-a.port" "$W/pulled-pull-warm"
rm -rf "$W/pulled-pull-warm" "$W/cache-pull-warm"
for round in $(seq "$ROUNDS"); do
  restore_check "streamed-$round" "$W/tier-a.port" "$REF" --plain-http --cache "$W/cache-streamed-$round"
  GPUSNAP_TIER_PREFILL=off restore_check "previous-$round" "$W/tier-a.port" "$REF" --plain-http \
    --cache "$W/cache-previous-$round"
  [[ $BUFFERED == 1 ]] && GPUSNAP_TIER_IN_PLACE=0 restore_check "buffered-$round" "$W/tier-a.port" \
    "$REF" --plain-http --cache "$W/cache-buffered-$round"
done

if [[ $COLD == 1 ]]; then
  # "registry": the registry's blobs alone leave the page cache (posix_fadvise DONTNEED on each
  # file), as on a node whose registry reads its disk while the node's own files (Python,
  # PyTorch's libraries, which CRIU's restore maps) stay cached; "all": every cache dropped.
  for scope in ${BENCH_COLD_SCOPES:-registry all}; do
    if [[ $scope == all ]]; then
      drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
    else
      drop() {
        sync
        find "$REGDIR/storage" -type f -print0 | python3 -c '
import os, sys
for p in sys.stdin.buffer.read().split(b"\0"):
    if p:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)'
      }
    fi
    for c in $(seq "${BENCH_COLD_ROUNDS:-1}"); do
      n=$scope-$c
      echo "== registry reading its disk (page cache dropped before each: $scope), round $c"
      drop; t=$(now)
      find "$REGDIR/storage" -type f -name data -size +1M -print0 | xargs -0 -P 16 -I{} dd if={} of=/dev/null bs=16M iflag=direct status=none
      echo "== the disk's own read of the registry's blobs (dd O_DIRECT, 16 at once): $(el "$t") s for $(du -sb "$REGDIR/storage" | cut -f1) bytes"
      drop; pull_alone "pull-cold-$n"; rm -rf "$W/pulled-pull-cold-$n" "$W/cache-pull-cold-$n"
      drop; restore_check "streamed-cold-$n" "$W/tier-a.port" "$REF" --plain-http --cache "$W/cache-streamed-cold-$n"
      if [[ $c == 1 ]]; then  # the previous path once a scope: it does not change between rounds
        drop; GPUSNAP_TIER_PREFILL=off restore_check "previous-cold-$n" "$W/tier-a.port" "$REF" --plain-http --cache "$W/cache-previous-cold-$n"
      fi
      if [[ $BUFFERED == 1 ]]; then
        drop; GPUSNAP_TIER_IN_PLACE=0 restore_check "buffered-cold-$n" "$W/tier-a.port" "$REF" --plain-http --cache "$W/cache-buffered-cold-$n"
      fi
    done
  done
fi

if [[ -n $KEYS ]]; then
  echo "== trust: the same snapshot signed, and encrypted, each in a repository of its own"
  printf '{"default":{"type":"reject"},"scopes":{"127.0.0.1:5124/bench/signed":{"type":"signed","keys":["%s"]}}}' \
    "$KEYS/sign.pub" >"$W/policy.json"
  printf '{"default":{"type":"accept"}}' >"$W/accept.json"
  push tier-a a plain
  push tier-a a signed --sign "$KEYS/sign.pem"
  push tier-a a enc --encrypt "$KEYS/node.pub" --dedup-secret "$KEYS/dedup.secret"
  for round in $(seq "${TRUST_ROUNDS:-1}"); do
    pull_alone "pull-plain-$round" oci://127.0.0.1:5124/bench/plain:a --signature-policy "$W/accept.json"
    rm -rf "$W/pulled-pull-plain-$round" "$W/cache-pull-plain-$round"
    pull_alone "pull-signed-$round" oci://127.0.0.1:5124/bench/signed:a --signature-policy "$W/policy.json"
    rm -rf "$W/pulled-pull-signed-$round" "$W/cache-pull-signed-$round"
    pull_alone "pull-enc-$round" oci://127.0.0.1:5124/bench/enc:a --decryption-key "$KEYS/node.pem"
    rm -rf "$W/pulled-pull-enc-$round" "$W/cache-pull-enc-$round"
    restore_check "trust-plain-$round" "$W/tier-a.port" oci://127.0.0.1:5124/bench/plain:a --plain-http \
      --cache "$W/cache-trust-plain-$round" --signature-policy "$W/accept.json"
    restore_check "trust-signed-$round" "$W/tier-a.port" oci://127.0.0.1:5124/bench/signed:a --plain-http \
      --cache "$W/cache-trust-signed-$round" --signature-policy "$W/policy.json"
    restore_check "trust-enc-$round" "$W/tier-a.port" oci://127.0.0.1:5124/bench/enc:a --plain-http \
      --cache "$W/cache-trust-enc-$round" --decryption-key "$KEYS/node.pem"
  done
fi

if [[ $DEDUP == 1 ]]; then
  echo "== dedup: a second capture of the same workload, pushed after the first"
  rm -rf "$W/tier-a"
  capture tier-b --tier; push tier-b b; rm -rf "$W/tier-b"
  echo "== dedup: a model that differs in 10 % of its weights (every tenth layer's low bit flipped)"
  python3 - "$WEIGHTS" "$W/weights-10.bin" <<'PY'
import sys
import numpy as np
src, dst = sys.argv[1], sys.argv[2]
layer = 8192 * 8192 * 2
with open(src, "rb") as f, open(dst, "wb") as g:
    i = 0
    while (b := f.read(layer)):
        if i % 10 == 0:
            a = np.frombuffer(b, dtype=np.int16).copy()
            a ^= 1
            b = a.tobytes()
        g.write(b)
        i += 1
print(f"   {i} layers, {len(range(0, i, 10))} changed")
PY
  WEIGHTS=$W/weights-10.bin capture tier-c --tier; push tier-c c; rm -rf "$W/tier-c" "$W/weights-10.bin"
  if [[ ${BENCH_DEDUP_PLAIN:-1} == 1 ]]; then
    capture plain-a --no-tier; push plain-a plain-a; rm -rf "$W/plain-a"
    capture plain-b --no-tier; push plain-b plain-b; rm -rf "$W/plain-b"
  fi
fi
echo "== done"
