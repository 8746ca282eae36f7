#!/usr/bin/env python3
"""The table (markdown, on stdout) and plot (OUTDIR/direct-host-images.svg) of
bench/gpu_direct_host_images.sh's results: per size and path, the capture's time (the checkpoint
without the source's resume), the driver's call, what followed it, and the peak host memory in use
(MemTotal - MemAvailable above the level before the capture) against the GPU bytes captured."""
import glob
import json
import os
import re
import sys

GIB = 1 << 30


def peak(path):
    """Peak rise of memory in use and of Shmem over the first sample, in bytes."""
    rows = [list(map(float, l.split())) for l in open(path) if l.strip()]
    if not rows:
        return None, None
    used = [(r[1] - r[2]) * 1024 for r in rows]
    shmem = [r[3] * 1024 for r in rows]
    return max(used) - used[0], max(shmem) - shmem[0]


def phases(doc):
    return {p["name"]: p["seconds"] for p in doc["phases"]}


def main():
    out = sys.argv[1]
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "cp-*-*.json")),
                       key=lambda p: (int(re.findall(r"cp-(\d+)-", p)[0]), p)):
        gib, mode = re.findall(r"cp-(\d+)-([\w-]+)\.json", path)[0]
        try:
            doc = json.load(open(path))
        except ValueError:
            continue
        ph = phases(doc)
        capture = doc["seconds"] - ph.get("gpu-resume", 0) - ph.get("resume", 0) - ph.get("stop", 0)
        gpu_bytes = sum(i["bytes"] for i in doc["host_images"])
        used, shmem = peak(os.path.join(out, "mem-%s-%s.tsv" % (gib, mode)))
        rows.append(dict(gib=int(gib), mode=mode.replace("-stop", ", source stopped"), capture=capture, driver=ph.get("gpu-checkpoint", 0),
                         host_images=ph.get("host-images", 0), hash=ph.get("host-images-hash", 0),
                         dump=ph.get("dump", 0), checksum=ph.get("checksum", 0),
                         resume=ph.get("gpu-resume", 0), gpu_bytes=gpu_bytes, used=used,
                         shmem=shmem))
    print("| GPU state | path | capture | driver's call | host-images | host-images-hash | dump "
          "| checksum | capture / driver's call | peak host memory in use (+Shmem) | peak / GPU "
          "state | source's gpu-resume |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print("| %.1f GiB | %s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f | "
              "%.1f GiB (%.1f GiB) | %.2f | %.2f s |" % (
                  r["gpu_bytes"] / GIB, r["mode"], r["capture"], r["driver"], r["host_images"],
                  r["hash"], r["dump"], r["checksum"], r["capture"] / r["driver"],
                  r["used"] / GIB, r["shmem"] / GIB, r["used"] / r["gpu_bytes"], r["resume"]))
    for path in sorted(glob.glob(os.path.join(out, "rs-*.json"))):
        gib = re.findall(r"rs-(\d+)\.json", path)[0]
        try:
            doc = json.load(open(path))
        except ValueError:
            continue
        used, shmem = peak(os.path.join(out, "mem-%s-restore.tsv" % gib))
        print("\nrestore of the %s GiB direct artifact: %.2f s (%s); peak host memory in use "
              "+%.2f GiB, Shmem +%.2f GiB" % (gib, doc["seconds"], ", ".join(
                  "%s %.2f s" % (k, v) for k, v in phases(doc).items()), used / GIB, shmem / GIB))
    svg(rows, os.path.join(out, "direct-host-images.svg"))


def svg(rows, path):
    """Two panels: capture time and peak memory against GPU bytes, per path."""
    if not rows:
        return
    w, h, pad = 360, 260, 45
    xmax = max(r["gpu_bytes"] for r in rows) / GIB * 1.1
    colours = {"copy": "#d62728", "direct": "#1f77b4", "driver": "#7f7f7f", "driver's": "#7f7f7f"}
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
             'font-family="sans-serif" font-size="11">' % (2 * w, h)]

    def panel(x0, title, series, ymax, unit):
        parts.append('<text x="%d" y="14">%s</text>' % (x0 + pad, title))
        parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' %
                     (x0 + pad, h - pad, x0 + w - 10, h - pad))
        parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' %
                     (x0 + pad, 20, x0 + pad, h - pad))
        parts.append('<text x="%d" y="%d">GPU state (GiB)</text>' % (x0 + w / 2 - 30, h - 10))
        for i in range(5):
            v = ymax * i / 4
            y = h - pad - (h - pad - 20) * i / 4
            parts.append('<text x="%d" y="%d" text-anchor="end">%.0f%s</text>' %
                         (x0 + pad - 4, y + 4, v, unit))
        for k, xs in enumerate(sorted({round(r["gpu_bytes"] / GIB) for r in rows})):
            x = x0 + pad + (w - pad - 10) * xs / xmax
            parts.append('<text x="%d" y="%d" text-anchor="middle">%d</text>' % (x, h - pad + 14, xs))
        for n, (name, pts) in enumerate(series.items()):
            pts = sorted(pts)
            coords = " ".join("%.1f,%.1f" % (x0 + pad + (w - pad - 10) * x / xmax,
                                             h - pad - (h - pad - 20) * y / ymax) for x, y in pts)
            parts.append('<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>' %
                         (coords, colours[name.split()[0]]))
            parts.append('<text x="%d" y="%d" fill="%s">%s</text>' %
                         (x0 + pad + 8, 32 + 13 * n, colours[name.split()[0]], name))

    t = {"copy capture": [], "direct capture": [], "driver's call (direct)": []}
    m = {"copy peak": [], "direct peak": [], "driver": []}
    # "direct, source stopped" plots as "direct": one run is either all --leave-running or not.
    rows = [dict(r, mode=r["mode"].split(",")[0]) for r in rows]
    rows = [r for r in rows if r["mode"] in ("copy", "direct")]
    if not rows:
        return
    for r in rows:
        g = r["gpu_bytes"] / GIB
        t[r["mode"] + " capture"].append((g, r["capture"]))
        if r["mode"] == "direct":
            t["driver's call (direct)"].append((g, r["driver"]))
        m[r["mode"] + " peak"].append((g, r["used"] / GIB))
    m.pop("driver")
    ymax_t = max(v for s in t.values() for _, v in s) * 1.15
    panel(0, "capture time (s)", t, ymax_t, "")
    m["driver GPU state (y = x)"] = [(r["gpu_bytes"] / GIB, r["gpu_bytes"] / GIB) for r in rows]
    colours["driver"] = "#7f7f7f"
    ymax_m = max(v for s in m.values() for _, v in s) * 1.15
    panel(w, "peak host memory in use (GiB)", m, ymax_m, "")
    parts.append("</svg>")
    open(path, "w").write("\n".join(parts))


if __name__ == "__main__":
    main()
