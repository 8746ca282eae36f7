#!/bin/bash
# exp29: why fresh memory is slow on these machines (free page reporting?), and what a CUDA
# context holds besides PyTorch's memory.
OUT=$1; L=$OUT/exp29.log; D=$(dirname "$0")
exec > >(tee -a "$L") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uname -r
echo "== virtio drivers"; ls /sys/bus/virtio/drivers/ 2>&1
for f in /sys/bus/virtio/devices/*; do echo "$f $(cat $f/device 2>/dev/null) features=$(cat $f/features 2>/dev/null)"; done
echo "== page reporting"; ls /sys/module/ | grep -i -E "page_reporting|balloon|hv_" ; cat /sys/module/page_reporting/parameters/page_reporting_order 2>&1
grep -i -E "balloon|reporting|hypervisor" /proc/cpuinfo | head -2; dmesg 2>/dev/null | grep -i -E "balloon|page_report|hypervisor|kvm" | head
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
grep -E "MemFree|MemTotal|AnonHuge" /proc/meminfo
echo "== first touch, 4 KiB pages, 4 GiB: fresh, again at once, after 1, 5, 15 s idle"
timeout 120 "$D/touch" 4096 0 0 1 5 15
echo "== the same with MADV_HUGEPAGE"
timeout 120 "$D/touch" 4096 1 0 1 5 15
echo "== 16 threads? no: one CPU's rate only. vmstat"
grep -E "^(thp_fault_alloc|thp_fault_fallback|pgfault|compact_stall)" /proc/vmstat
echo "== CUDA context probe"
timeout 120 python3 "$D/ctx_probe.py"
date -u
