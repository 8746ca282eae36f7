#!/usr/bin/env python3
"""The registry's own ceiling for `bench/run pull-ceiling`: every blob of one manifest fetched
with N threads of Python's http.client (keep-alive, one connection per thread, bytes read into
a reused buffer and dropped), so that the rate is the registry's and the loopback's, not a
client's storage or hashing. Plain HTTP only (the bench's registry on loopback).

usage: fetch_blobs.py HOST:PORT REPOSITORY TAG THREADS   -> prints "BYTES SECONDS BLOBS"
"""
import http.client
import json
import sys
import threading
import time

ACCEPT = "application/vnd.oci.image.manifest.v1+json"


def main() -> int:
    host, repo, tag, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    conn = http.client.HTTPConnection(host, timeout=60)
    conn.request("GET", f"/v2/{repo}/manifests/{tag}", headers={"Accept": ACCEPT})
    resp = conn.getresponse()
    if resp.status != 200:
        print(f"fetch_blobs: manifest: HTTP {resp.status}", file=sys.stderr)
        return 1
    manifest = json.loads(resp.read(64 << 20))
    digests = [layer["digest"] for layer in manifest.get("layers", [])]
    lock = threading.Lock()
    total = [0]
    errors = []

    def worker(k: int) -> None:
        c = http.client.HTTPConnection(host, timeout=60)
        buf = memoryview(bytearray(1 << 20))
        got = 0
        for d in digests[k::threads]:
            c.request("GET", f"/v2/{repo}/blobs/{d}")
            r = c.getresponse()
            if r.status != 200:
                errors.append(f"{d}: HTTP {r.status}")
                r.read()
                continue
            while True:
                n = r.readinto(buf)
                if not n:
                    break
                got += n
        with lock:
            total[0] += got

    t0 = time.monotonic()
    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.monotonic() - t0
    if errors:
        print("fetch_blobs: " + "; ".join(errors[:3]), file=sys.stderr)
        return 1
    print(total[0], f"{seconds:.3f}", len(digests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
