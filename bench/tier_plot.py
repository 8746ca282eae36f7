#!/usr/bin/env python3
"""The plot of bench/tier_bench.sh's results (OUTDIR/tier-GIB.json -> OUTDIR/tier-GIB.svg):
restore to the first correct answer and capture, transparent path against the memory tier, as
horizontal bars in seconds, with the targets (restore 1.0 s, capture 2.0 s) as lines.

    bench/tier_plot.py OUTDIR/tier-16.json [OUT.svg]
"""
import json
import statistics
import sys


def main():
    doc = json.load(open(sys.argv[1]))
    out = sys.argv[2] if len(sys.argv) > 2 else sys.argv[1].rsplit(".", 1)[0] + ".svg"
    rows = doc["rows"]
    bars = []
    for measure, key, target in (("restore to answer", "restore_s", 1.0),
                                 ("capture", "capture_s", 2.0)):
        for mode, colour in (("transparent", "#8a8a8a"), ("tier", "#2a6fdb"), ("tier-no-prefill", "#9ecae1")):
            values = [r[key] for r in rows if r["mode"] == mode and r[key] is not None]
            if values:
                bars.append((f"{measure}, {mode}", statistics.median(values), colour, target))
    scale = 120.0  # pixels per second
    top, left, height, gap = 40, 190, 22, 10
    longest = max([b[1] for b in bars] + [2.0])
    width = left + int(longest * scale) + 80
    total = top + len(bars) * (height + gap) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" '
             'font-family="sans-serif" font-size="12">',
             f'<text x="{left}" y="20" font-size="14">{doc["gib"]:g} GiB PyTorch with a CUDA graph, '
             'H200: transparent path and memory tier (median seconds)</text>']
    for i, (label, value, colour, target) in enumerate(bars):
        y = top + i * (height + gap)
        parts.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{label}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{value * scale:.1f}" height="{height}" '
                     f'fill="{colour}"/>')
        parts.append(f'<text x="{left + value * scale + 6:.1f}" y="{y + 15}">{value:.2f} s</text>')
        tx = left + target * scale
        parts.append(f'<line x1="{tx:.1f}" y1="{y - 3}" x2="{tx:.1f}" y2="{y + height + 3}" '
                     'stroke="#d33" stroke-dasharray="3,2"/>')
    parts.append(f'<text x="{left}" y="{total - 8}" fill="#d33">dashed: the target '
                 '(restore 1.0 s, capture 2.0 s)</text>')
    parts.append("</svg>")
    open(out, "w").write("\n".join(parts) + "\n")
    print(out)


if __name__ == "__main__":
    main()
