#!/usr/bin/env python3
"""What a user does on a fresh node instead of restoring a snapshot, for
`bench/run gpu-llama-fresh-node`: the model's safetensors kept in the same registry as an OCI
artifact (one layer per file, named by its org.opencontainers.image.title annotation, as ORAS
stores files), fetched onto the node, then loaded by transformers' from_pretrained and asked
for tokens.

  llama_files.py make DIR [--layers N]          Llama-3-8B's shape, random bf16, save_pretrained
  llama_files.py push HOST:PORT REPO TAG DIR    every file of DIR as a layer (untimed set-up)
  llama_files.py fetch HOST:PORT REPO TAG DIR [THREADS]
                                                every layer into DIR by its title: 64 MiB ranges
                                                over THREADS connections (default 16), no digest
                                                check (a generous client); prints "BYTES SECONDS"
  llama_files.py load DIR [--new-tokens N]      from_pretrained onto the GPU, generate(); prints
                                                one JSON line of timings from the process's start

Plain HTTP only (the bench's registry on loopback). The model's config matches
tests/gpu/workloads/llama_tier.py, the workload gpusnap captures in the same scenario.
"""
import argparse
import hashlib
import http.client
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

T0 = time.monotonic()
PART = 64 << 20
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def llama_config(transformers, torch, layers):
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=layers, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0,
                                    torch_dtype=torch.bfloat16)


def make(args):
    import torch
    import transformers
    torch.manual_seed(1)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(llama_config(transformers, torch, args.layers))
    model.save_pretrained(args.dir, safe_serialization=True)
    total = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
    print(f"made {args.dir}: {total} bytes in {time.monotonic() - T0:.1f} s", flush=True)


def request(host, method, path, body=None, headers=None, expect=(200,)):
    c = http.client.HTTPConnection(host, timeout=600)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read(64 << 20)
    if r.status not in expect:
        raise RuntimeError(f"{method} {path}: HTTP {r.status} {data[:200]!r}")
    return r, data


def upload(host, repo, path=None, data=None):
    """One blob, monolithic (POST then PUT with the digest); returns its descriptor."""
    h = hashlib.sha256()
    if data is None:
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        size = os.path.getsize(path)
    else:
        h.update(data)
        size = len(data)
    digest = "sha256:" + h.hexdigest()
    r, _ = request(host, "POST", f"/v2/{repo}/blobs/uploads/", expect=(202,))
    loc = r.getheader("Location")
    loc = loc[loc.index("/v2/"):] if "://" in loc else loc
    sep = "&" if "?" in loc else "?"
    headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
    if data is None:
        with open(path, "rb") as f:
            request(host, "PUT", f"{loc}{sep}digest={digest}", body=f, headers=headers,
                    expect=(201,))
    else:
        request(host, "PUT", f"{loc}{sep}digest={digest}", body=data, headers=headers,
                expect=(201,))
    return {"digest": digest, "size": size}


def push(args):
    files = sorted(f for f in os.listdir(args.dir) if os.path.isfile(os.path.join(args.dir, f)))
    with ThreadPoolExecutor(len(files)) as pool:
        descs = list(pool.map(lambda f: upload(args.host, args.repo, os.path.join(args.dir, f)),
                              files))
    layers = [dict(d, mediaType="application/vnd.oci.image.layer.v1.tar",
                   annotations={"org.opencontainers.image.title": f})
              for f, d in zip(files, descs)]
    cfg = json.dumps({"architecture": "amd64", "os": "linux",
                      "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    config = dict(upload(args.host, args.repo, data=cfg),
                  mediaType="application/vnd.oci.image.config.v1+json")
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": config,
                           "layers": layers}).encode()
    request(args.host, "PUT", f"/v2/{args.repo}/manifests/{args.tag}", body=manifest,
            headers={"Content-Type": MANIFEST}, expect=(201,))
    print(f"pushed {len(files)} files, {sum(d['size'] for d in descs)} bytes", flush=True)


def fetch(args):
    t0 = time.monotonic()
    _, data = request(args.host, "GET", f"/v2/{args.repo}/manifests/{args.tag}",
                      headers={"Accept": MANIFEST})
    layers = json.loads(data)["layers"]
    os.makedirs(args.dir, exist_ok=True)
    fds, parts = [], []
    for layer in layers:
        name = os.path.basename(layer["annotations"]["org.opencontainers.image.title"])
        fd = os.open(os.path.join(args.dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, layer["size"])
        fds.append(fd)
        parts += [(fd, layer["digest"], at, min(PART, layer["size"] - at))
                  for at in range(0, layer["size"], PART)]
    local = threading.local()

    def get(part):
        fd, digest, at, n = part
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(args.host, timeout=600)
        local.conn.request("GET", f"/v2/{args.repo}/blobs/{digest}",
                           headers={"Range": f"bytes={at}-{at + n - 1}"})
        r = local.conn.getresponse()
        if r.status != 206:  # a registry that ignores Range would send the whole blob each time
            raise RuntimeError(f"GET {digest} bytes {at}-{at + n - 1}: HTTP {r.status}")
        buf = r.read()
        if len(buf) != n:
            raise RuntimeError(f"GET {digest} bytes {at}-{at + n - 1}: {len(buf)} bytes")
        os.pwrite(fd, buf, at)
        return len(buf)

    with ThreadPoolExecutor(args.threads) as pool:
        got = sum(pool.map(get, parts))
    for fd in fds:
        os.close(fd)
    print(f"{got} {time.monotonic() - t0:.3f}", flush=True)


def load(args):
    import torch
    import transformers
    t_import = time.monotonic() - T0
    how = "device_map=cuda"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.dir, torch_dtype=torch.bfloat16, device_map="cuda")
    except Exception as e:  # noqa: BLE001 - device_map needs accelerate; say what was used
        how = f"to(cuda) after {type(e).__name__}"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.dir, torch_dtype=torch.bfloat16).to("cuda")
    model.eval()
    torch.cuda.synchronize()
    t_loaded = time.monotonic() - T0
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0)
    tokens = out.shape[1] - prompt.shape[1]
    print(json.dumps({"import_s": round(t_import, 3), "loaded_s": round(t_loaded, 3),
                      "tokens_s": round(time.monotonic() - T0, 3), "tokens": int(tokens),
                      "how": how}), flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--layers", type=int, default=32)
    for name in ("push", "fetch"):
        s = sub.add_parser(name)
        s.add_argument("host")
        s.add_argument("repo")
        s.add_argument("tag")
        s.add_argument("dir")
        if name == "fetch":
            s.add_argument("threads", type=int, nargs="?", default=16)
    ld = sub.add_parser("load")
    ld.add_argument("dir")
    ld.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    {"make": make, "push": push, "fetch": fetch, "load": load}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
