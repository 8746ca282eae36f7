"""A Python workload for `gpusnap run --memory-tier` in the system tests: it speaks the handshake
through gpusnap_handshake.Client but never calls use_memory_tier(). It imports torch (where there
is no PyTorch, the stand-in of tests/workload/torch_standin, on the PYTHONPATH gpusnap was
started with), then writes what it sees to --report as JSON, says READY and serves the handshake
until it is stopped:

  pid, PYTHONPATH, GPUSNAP_MEMORY_TIER    its own pid, and the variables gpusnap gave it
  handshake_file                          where the gpusnap_handshake it imported came from
  tier_path                               the library of the tier the client drains and fills
                                          (null: none installed)
  torch_log                               the stand-in's log ($TORCH_STANDIN_LOG), when set

  python3 tier_site_probe.py --report PATH
"""

import argparse
import json
import os
import time

import torch  # noqa: F401 - gpusnap's sitecustomize installs the tier here

import gpusnap_handshake


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    args = p.parse_args()
    client = gpusnap_handshake.Client.from_environment()
    tier = client._tier()  # what the client drains at a pause and fills at a resume
    log = os.environ.get("TORCH_STANDIN_LOG")
    torch_log = None
    if log and os.path.exists(log):
        with open(log) as f:
            torch_log = f.read().splitlines()
    report = {"pid": os.getpid(), "PYTHONPATH": os.environ.get("PYTHONPATH"),
              "GPUSNAP_MEMORY_TIER": os.environ.get("GPUSNAP_MEMORY_TIER"),
              "handshake_file": gpusnap_handshake.__file__,
              "tier_path": getattr(tier, "path", None), "torch_log": torch_log}
    with open(args.report + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(args.report + ".tmp", args.report)
    client.serve(on_pause=lambda: True, on_resume=lambda context: True)
    client.ready()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
