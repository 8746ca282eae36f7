"""A transformers LlamaForCausalLM of Llama-3-8B's shape (bf16, random weights), greedy
generate(), speaking the handshake, with or without gpusnap's memory tier: the tier's benchmark
against the transparent path for a real model class. With --tier (the default)
gpusnap_handshake.use_memory_tier() is called before anything touches CUDA.
Serves line commands on TCP 127.0.0.1:--port:
  CHECK   -> OK tokens=<n> same=1 pid=<pid>   generate() again, compared token for token with
             FAIL ...                         the answer computed before the capture
  INFO    -> pid=<pid> layers=<L> tier=<0|1> ready_s=<s>
--ready-file PATH receives the port once READY was said (atomically). --layers makes it smaller
(32 is Llama-3-8B's depth: ~16 GB of weights).
"""
import argparse
import os
import sys
import time

T0 = time.monotonic()

import gpusnap_handshake  # noqa: E402  (beside this file in the build tree)
import line_server  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    line_server.add_tier_workload_arguments(p)
    return p.parse_args()


def main():
    args = parse_args()
    tier = gpusnap_handshake.use_memory_tier() if args.tier else None  # before any allocation
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    torch.manual_seed(1)
    # Llama-3-8B's shape.
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=args.layers, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, rope_theta=500000.0,
                                      torch_dtype=torch.bfloat16)
    # Made on the GPU in bf16 at once: random initialisation there takes seconds, not minutes.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 32), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7))

    def generate():
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
        return out.cpu()

    expected = generate()
    ready_s = time.monotonic() - T0
    srv = line_server.listen(args.port)
    port = srv.getsockname()[1]

    def on_pause():
        torch.cuda.synchronize()
        return True

    def on_resume(context):
        print(f"resumed restored={context.restored} t={time.time():.3f}", flush=True)
        return True

    hs = gpusnap_handshake.Client.from_environment()
    hs.serve(on_pause, on_resume)
    hs.ready()
    print(f"ready port={port} pid={os.getpid()} ready_s={ready_s:.2f} tier={int(tier is not None)} "
          f"params={sum(p.numel() for p in model.parameters())}", flush=True)
    if args.ready_file:
        line_server.write_ready_file(args.ready_file, port)

    def handle(cmd):
        if cmd == "CHECK":
            got = generate()
            if torch.equal(got, expected):
                return f"OK tokens={got.shape[1]} same=1 pid={os.getpid()}"
            return f"FAIL expected={expected.tolist()} got={got.tolist()}"
        if cmd == "INFO":
            return (f"pid={os.getpid()} layers={args.layers} tier={int(tier is not None)} "
                    f"ready_s={ready_s:.2f}")
        if cmd == "PING":
            return "PONG"
        return "ERR unknown command"

    line_server.serve_lines(srv, handle)


if __name__ == "__main__":
    sys.exit(main())
