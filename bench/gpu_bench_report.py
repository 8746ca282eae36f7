#!/usr/bin/env python3
"""Table and plot of bench/gpu_bench.sh's results.

    bench/gpu_bench_report.py OUTDIR

Reads OUTDIR/gpu-bench-*.json, writes OUTDIR/gpu-bench.md (a Markdown table: cold start, the
plain pipeline and gpusnap, checkpoint and restore, with gpusnap's phases) and, where
matplotlib is installed, OUTDIR/gpu-bench.png (restore and checkpoint times side by side).
"""
import glob
import json
import os
import sys


def load(outdir):
    docs = [json.load(open(p)) for p in glob.glob(os.path.join(outdir, "gpu-bench-*.json"))]
    return sorted(docs, key=lambda d: (d["storage"] != "ram", d["gib"]))


def phases(doc):
    return {p["name"]: p["seconds"] for p in doc.get("phases", [])}


def table(docs):
    rows = ["| GPU state | artifact in | cold start | plain restore | gpusnap restore | speed-up "
            "| plain checkpoint | gpusnap checkpoint | speed-up | plain artifact | gpusnap artifact (stored) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in docs:
        p, g = d["plain"], d["gpusnap"]
        where = f'{d["storage"]} ({d["fs"]})' + ("" if not p.get("cache_dropped") else ", cache dropped")
        rows.append(
            f'| {d["gib"]:g} GiB | {where} | {d["cold_start_s"]:.2f} s '
            f'| {p["restore_to_answer_s"]:.2f} s | {g["restore_to_answer_s"]:.2f} s '
            f'| {p["restore_to_answer_s"] / g["restore_to_answer_s"]:.1f}x '
            f'| {p["checkpoint_s"]:.2f} s | {g["checkpoint_s"]:.2f} s '
            f'| {p["checkpoint_s"] / g["checkpoint_s"]:.1f}x '
            f'| {p["artifact_bytes"] / 2**30:.2f} GiB '
            f'| {g["artifact_apparent_bytes"] / 2**30:.2f} GiB ({g["artifact_allocated_bytes"] / 2**30:.2f} GiB) |')
    rows.append("")
    rows.append("Phases (seconds):")
    rows.append("")
    for d in docs:
        p, g = d["plain"], d["gpusnap"]
        cp = ", ".join(f"{k} {v:.2f}" for k, v in phases(g["checkpoint"]).items())
        rs = ", ".join(f"{k} {v:.2f}" for k, v in phases(g["restore"]).items())
        rows.append(f'- {d["gib"]:g} GiB, {d["storage"]}: plain checkpoint: driver lock+checkpoint '
                    f'{p["gpu_lock_checkpoint_s"]:.2f}, criu dump {p["criu_dump_s"]:.2f}; plain restore: '
                    f'criu restore {p["criu_restore_s"]:.2f}, driver restore+unlock '
                    f'{p["gpu_restore_unlock_s"]:.2f}. gpusnap checkpoint: {cp}. gpusnap restore: {rs}.')
    return "\n".join(rows) + "\n"


def plot(docs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f'{d["gib"]:g} GiB\n{d["storage"]}' for d in docs]
    x = range(len(docs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.27
    ax1.bar([i - w for i in x], [d["cold_start_s"] for d in docs], w, label="cold start")
    ax1.bar(list(x), [d["plain"]["restore_to_answer_s"] for d in docs], w, label="plain CRIU + driver")
    ax1.bar([i + w for i in x], [d["gpusnap"]["restore_to_answer_s"] for d in docs], w, label="gpusnap")
    ax1.set_title("Start to first correct answer")
    ax2.bar([i - w / 2 for i in x], [d["plain"]["checkpoint_s"] for d in docs], w, label="plain CRIU + driver",
            color="C1")
    ax2.bar([i + w / 2 for i in x], [d["gpusnap"]["checkpoint_s"] for d in docs], w, label="gpusnap",
            color="C2")
    ax2.set_title("Checkpoint")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels)
        ax.set_ylabel("seconds")
        ax.legend()
    fig.suptitle("PyTorch workload on one H200 (bench/gpu_bench.sh)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    outdir = sys.argv[1]
    docs = load(outdir)
    if not docs:
        sys.exit(f"no gpu-bench-*.json in {outdir}")
    with open(os.path.join(outdir, "gpu-bench.md"), "w") as f:
        f.write(table(docs))
    print(table(docs))
    try:
        plot(docs, os.path.join(outdir, "gpu-bench.png"))
    except ImportError:
        sys.exit("no matplotlib here: the table is written; make the plot where it is installed")


if __name__ == "__main__":
    main()
