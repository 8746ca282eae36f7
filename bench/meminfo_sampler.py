#!/usr/bin/env python3
"""Samples /proc/meminfo every 100 ms until killed: one line per sample, "SECONDS MemTotal
MemAvailable Shmem Dirty Writeback" (kB), into the file named first. bench/gpu_direct_host_images.sh uses it for
the host memory a capture holds (MemTotal - MemAvailable: memory that cannot be reclaimed; with
a store on disk, Dirty + Writeback are the page cache not yet written back)."""
import signal
import sys
import time

FIELDS = ("MemTotal:", "MemAvailable:", "Shmem:", "Dirty:", "Writeback:")


def sample():
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split()[:2]
            if key in FIELDS:
                values[key] = value
    return [values[k] for k in FIELDS]


def main():
    out = open(sys.argv[1], "w", buffering=1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    t0 = time.monotonic()
    while True:
        out.write("%.2f %s\n" % (time.monotonic() - t0, " ".join(sample())))
        time.sleep(0.1)


if __name__ == "__main__":
    main()
