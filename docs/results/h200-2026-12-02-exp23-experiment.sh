#!/usr/bin/env bash
# exp23 (issue 17): why the tier's pause took 2.0-2.3 s when the capture came straight after the
# workload wrote its weights into the same tmpfs. Three captures of the same 16 GiB tier
# workload on one fresh machine, with the kernel's counters around each:
#   p1: weights written by this run (the first memory this machine's guest ever touches),
#   p2: the same weights file, made by p1 (the bench's case),
#   p3: a new weights file written by this run into memory p1 and p2 used and gave back.
# Before them, dd's own rate into the tmpfs on fresh and on reused memory.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp23.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp23.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b21
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2
uptime; grep -E "MemFree|MemAvailable|Shmem|Cached" /proc/meminfo
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
W=$S/w; mkdir -p $W
vm() { grep -E "^(compact_stall|compact_fail|compact_success|thp_file_alloc|thp_file_fallback|thp_fault_fallback|pgfault|pgmajfault|allocstall_normal|pgscan_direct|pgsteal_direct|pgalloc_normal|pgfree|nr_free_pages) " /proc/vmstat | tr '\n' ' '; echo; }
ddrate() {  # ddrate FILE GIB TAG
  local t1=$(date +%s.%N)
  dd if=/dev/zero of=$1 bs=16M count=$(( $2 * 64 )) status=none
  local t2=$(date +%s.%N)
  python3 -c "import sys; s=float(sys.argv[2])-float(sys.argv[1]); print('== dd $3: %d GiB in %.3f s, %.2f GB/s' % (int(sys.argv[3]), s, int(sys.argv[3])*2**30/s/1e9))" $t1 $t2 $2
}
echo "--- dd into the tmpfs"
ddrate $W/dd1 8 "fresh memory"; rm -f $W/dd1
ddrate $W/dd2 8 "the same memory again"; rm -f $W/dd2
export GPUSNAP_TIER_LOG=1
cap() {  # cap TAG WEIGHTS
  echo "--- $1 (weights $2 $( [[ -e $2 ]] && echo exists || echo 'to be written' ))"
  echo "before: $(vm)"; grep -E "MemFree|ShmemHugePages|ShmemPmdMapped" /proc/meminfo | tr -s ' ' | tr '\n' ' '; echo
  timeout $(( $(left) - 20 )) $B/gpusnap run -o $W/$1 --json -- python3 $B/tests/torch_tier.py --tier --gib 16 \
    --weights $2 --ready-file $W/$1.port >$R/$1-run.json 2>$R/$1-run.err
  echo "== $1 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/$1-run.json
  echo "after: $(vm)"
  grep -h "gpusnap-tier:" $R/$1-run.err | head -3
  finish
}
cap p1 $W/weights.bin
rm -rf $W/p1
(( $(left) > 120 )) && cap p2 $W/weights.bin
rm -rf $W/p2 $W/weights.bin
(( $(left) > 150 )) && cap p3 $W/weights3.bin
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
