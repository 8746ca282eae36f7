#!/usr/bin/env bash
# exp41: why CRIU's restore of a tier copy takes longer in a placeholder than on the host (exp36:
# 0.70-1.06 s against 0.35-0.55 s): 8 GiB tests/torch_tier.py with the tier in a runc container
# and on the host, restores taking turns, CRIU's own log of each restore kept.
OUT=$1; DEADLINE=${2:-240}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp41.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp41.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
export PATH=$PWD/.carry/runc:$PATH
B=$PWD/.carry/b41
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH python3=$(command -v python3) nsenter=$(command -v nsenter)"
runc --version | head -1
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1" 2>&1 | cut -c1-900; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
gpu_idle() { for _ in $(seq 100); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && return; sleep 0.05; done; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=100g gpusnap $S
dd if=/dev/zero of=$S/touch bs=16M count=1280 status=none; rm -f $S/touch
echo "touched 20 GiB t=$(( $(date +%s) - T0 ))s"
W=$S/w; D=$S/data; BUN=$S/bundles; mkdir -p $W $D $BUN
ROOTFS=$S/rootfs
mkdir -p $ROOTFS/{usr,etc,opt,proc,dev,sys,tmp,control,gpusnap,data}
for l in bin lib lib64 sbin; do ln -s usr/$l $ROOTFS/$l; done
PYTHON=$(command -v python3)  # the venv's own name: its pyvenv.cfg is found beside it
echo "python: $PYTHON"

# bundle NAME ARG... : an OCI bundle in $BUN/NAME whose process runs ARG...
bundle() {
  local name=$1; shift
  mkdir -p $BUN/$name && (cd $BUN/$name && runc spec) || return 1
  python3 - "$BUN/$name/config.json" "$ROOTFS" "$B" "$D" "$@" <<'EOF'
import json, os, sys
path, rootfs, carry, data, *args = sys.argv[1:]
c = json.load(open(path))
c["root"] = {"path": rootfs, "readonly": False}
p = c["process"]
p["terminal"] = False
p["args"] = args
p["cwd"] = "/"
env = ["PATH=/opt/torch/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "HOME=/tmp", "GPUSNAP_CONTROL_DIR=/control", "PYTHONPATH=/gpusnap/tests",
       "PYTHONDONTWRITEBYTECODE=1", "GPUSNAP_TIER_LOG=1"]
for k, v in os.environ.items():
    if k == "LD_LIBRARY_PATH" or k.startswith(("CUDA_", "NVIDIA_")):
        env.append(f"{k}={v}")
p["env"] = env
m = c["mounts"]
for src in ("/usr", "/etc", "/opt"):
    m.append({"destination": src, "type": "bind", "source": src, "options": ["rbind", "ro"]})
m.append({"destination": "/gpusnap", "type": "bind", "source": carry, "options": ["rbind", "ro"]})
m.append({"destination": "/data", "type": "bind", "source": data, "options": ["rbind", "rw"]})
m.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]})
m.append({"destination": "/control", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=700"]})
for dev in [d for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools") if os.path.exists(d)]:
    m.append({"destination": dev, "type": "bind", "source": dev, "options": ["bind", "rw"]})
c["linux"].setdefault("resources", {})["devices"] = [{"allow": True, "access": "rwm"}]
json.dump(c, open(path, "w"), indent=1)
EOF
}
cpid() { runc state $1 2>/dev/null | python3 -c 'import json,sys;print(json.load(sys.stdin)["pid"])' 2>/dev/null; }
ask_in() {  # ask_in PID CMD: one line to 127.0.0.1:7000 in PID's network namespace
  timeout 120 nsenter -t $1 -n bash -c "exec 3<>/dev/tcp/127.0.0.1/7000; echo $2 >&3; read -r r <&3; echo \$r"
}

# 2. Source containers, captured (each stops its source, as `gpusnap checkpoint` does).
source_capture() {  # source_capture TAG --tier|--no-tier
  local tag=$1
  bundle src-$tag /gpusnap/gpusnap init -- $PYTHON /gpusnap/tests/torch_tier.py $2 --gib 8 \
    --weights /data/weights.bin --port 7000 --ready-file /data/$tag.port
  gpu_idle
  local t1=$(date +%s.%N)
  runc run -d --bundle $BUN/src-$tag src-$tag > >(cat > $R/src-$tag.out) 2>&1 || { echo "runc run src-$tag failed"; cat $R/src-$tag.out; return 1; }
  for _ in $(seq 1800); do [[ -f $D/$tag.port ]] && break; sleep 0.1; done
  local t2=$(date +%s.%N)
  local pid; pid=$(cpid src-$tag)
  echo "== src-$tag ready in $(sec $t1 $t2) s (pid $pid): $(ask_in $pid CHECK)"
  timeout 200 $B/gpusnap checkpoint --container src-$tag -o $W/$tag --json > $R/$tag-cp.json 2> $R/$tag-cp.err
  local rc=$? t3=$(date +%s.%N)
  echo "== $tag capture rc=$rc in $(sec $t2 $t3) s t=$(( $(date +%s) - T0 ))s"; phases $R/$tag-cp.json
  grep -A5 '"notes"' $R/$tag-cp.json | head -7
  tail -3 $R/$tag-cp.err
  ls $W/$tag/tier 2>/dev/null | head -5; du -sh $W/$tag 2>/dev/null
  grep -h "gpusnap-tier" $R/src-$tag.out | tail -2
  python3 -c "import json,sys;m=json.load(open(sys.argv[1]));f=m['container']['rootfs_files'];print('rootfs_files', len(f), 'bytes', sum(x['size'] for x in f), 'by build-id', sum(1 for x in f if x.get('build_id')), 'hashed bytes', sum(x['size'] for x in f if not x.get('build_id')))" $W/$tag/manifest.json
  runc delete -f src-$tag >/dev/null 2>&1
}
source_capture ctier --tier
finish

# The same workload on the host, transparent, for the host's restore in the same run.
if (( $(left) > 90 )); then
  gpu_idle
  timeout 200 $B/gpusnap run -o $W/htier --json -- $PYTHON $B/tests/torch_tier.py --tier --gib 8 \
    --weights $D/weights.bin --ready-file $W/htier.port > $R/htier-run.json 2> $R/htier-run.err
  echo "== htier capture rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/htier-run.json
  grep -A3 '"notes"' $R/htier-run.json | head -4
fi

restore_into() {  # restore_into TAG N [verify]
  local tag=$1 ph=ph-$1-$2
  bundle $ph /gpusnap/gpusnap init --placeholder
  runc run -d --bundle $BUN/$ph $ph > >(cat > $R/$ph.out) 2>&1 || { echo "runc run $ph failed"; return 1; }
  local pid; for _ in $(seq 100); do pid=$(cpid $ph); [[ -n $pid ]] && break; sleep 0.05; done
  sleep 0.2; gpu_idle
  local t1=$(date +%s.%N)
  timeout 90 $B/gpusnap restore $W/$tag --into-container $ph --json > $R/$ph-rs.json 2> $R/$ph-rs.err
  local rc=$? t2=$(date +%s.%N)
  local ans; ans=$(ask_in $pid CHECK); local t3=$(date +%s.%N)
  echo "== $ph restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$ph-rs.json; tail -2 $R/$ph-rs.err
  local log; log=$(ls -td /run/gpusnap/copies/*/ | head -1)restore.log
  cp "$log" $R/$ph-restore.log; (( rc != 0 )) && grep -h "Error" "$log" | tail -4
  grep -h "gpusnap-tier\|handshake" $R/$ph.out | tail -3
  [[ -n ${3:-} ]] && echo "   VERIFY: $(ask_in $pid VERIFY)"
  runc delete -f $ph >/dev/null 2>&1; sleep 0.5
}
restore_host() {  # restore_host N
  local port; port=$(cat $W/htier.port); gpu_idle
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $W/htier --publish $port --json > $R/htier-rs-$1.json 2> $R/htier-rs-$1.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/htier-rs-$1.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(timeout 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$hp; echo CHECK >&3; read -r r <&3; echo \$r")
  local t3=$(date +%s.%N)
  echo "== htier-$1 restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/htier-rs-$1.json
  cp "$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['copies'][0]['dir'])" $R/htier-rs-$1.json)/restore.log" $R/htier-$1-restore.log
  kill -9 $(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['copies'][0]['init_pid'])" $R/htier-rs-$1.json) 2>/dev/null; sleep 0.5
}
for n in 1 2; do
  (( $(left) > 20 )) || { echo "NOT RUN (time): round $n"; break; }
  restore_into ctier $n; finish
  [[ -d $W/htier ]] && { restore_host $n; finish; }
done
echo "mounts left in this namespace: $(grep -c gpusnap-tier /proc/self/mountinfo)"
rm -rf $W $D
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
