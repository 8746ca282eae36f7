#!/usr/bin/env python3
"""An experiment, not a product path: how does the driver's checkpoint fill the region it maps?

Starts tests/cuda_pattern with GIB GiB on the GPU, locks it, then runs the driver's checkpoint
(bench/cuda-checkpoint-tool) while reading the process's /proc/PID/smaps every few ms. For each
sample, the largest anonymous region that was not there before: its size, its resident bytes and
its VmFlags. If Rss reaches the full size long before the call returns, the pages are put in
place up front (and advice on the region from outside comes too late); if Rss grows for the
whole call, the pages are faulted as the copy goes.

    BUILD=build bench/driver_region_watch.py OUTDIR [GIB]

Writes OUTDIR/driver-region-GIB.json (the samples and the call's duration).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

out_dir = sys.argv[1]
gib = float(sys.argv[2]) if len(sys.argv) > 2 else 4
build = os.environ.get("BUILD", "build")
tool = f"{build}/bench/cuda-checkpoint-tool"
os.makedirs(out_dir, exist_ok=True)


def regions(pid):
    """{start: (size_kib, rss_kib, flags)} of anonymous private mappings."""
    found, current = {}, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                start, end = (int(x, 16) for x in head[0].split("-"))
                anon = len(head) == 5 and head[1].endswith("p")
                current = start if anon else None
                if anon:
                    found[start] = [(end - start) // 1024, 0, ""]
            elif current is not None and head[0] == "Rss:":
                found[current][1] = int(head[1])
            elif current is not None and head[0] == "VmFlags:":
                found[current][2] = " ".join(head[1:])
    return found


ready = tempfile.mktemp(prefix="region-ready.")
proc = subprocess.Popen([f"{build}/tests/cuda_pattern", "--gib", str(gib), "--ready-file", ready],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    while not (os.path.exists(ready) and os.path.getsize(ready) > 0):
        time.sleep(0.05)
        if proc.poll() is not None:
            sys.exit("cuda_pattern exited")
    subprocess.run([tool, "lock", str(proc.pid)], check=True)
    before = set(regions(proc.pid))
    t0 = time.time()
    call = subprocess.Popen([tool, "checkpoint", str(proc.pid)])
    samples = []
    while call.poll() is None:
        now = regions(proc.pid)
        new = {s: v for s, v in now.items() if s not in before}
        if new:
            start, (size, rss, flags) = max(new.items(), key=lambda kv: kv[1][0])
            samples.append({"t": round(time.time() - t0, 4), "start": hex(start),
                            "size_kib": size, "rss_kib": rss, "flags": flags})
        time.sleep(0.005)
    took = time.time() - t0
    final = {s: v for s, v in regions(proc.pid).items() if s not in before}
    subprocess.run([tool, "restore", str(proc.pid)], check=True)
    subprocess.run([tool, "unlock", str(proc.pid)], check=True)
    doc = {"gib": gib, "checkpoint_s": round(took, 3), "returncode": call.returncode,
           "samples": samples,
           "final": {hex(s): v for s, v in final.items()}}
    with open(f"{out_dir}/driver-region-{gib:g}.json", "w") as f:
        json.dump(doc, f, indent=1)
    # A short view: the first sample, then every ~10 % of the call.
    shown = samples[:1] + [s for i, s in enumerate(samples) if i % max(1, len(samples) // 10) == 0]
    for s in shown:
        print(s)
    print("checkpoint_s", doc["checkpoint_s"])
finally:
    proc.kill()
