"""A decode step as a serving engine runs it: a paged FP8 KV cache, a block table, top-k positions.

    python examples/decode.py                  # CPU: small shapes, the reference backend
    python examples/decode.py --format fp8_model1
    python examples/decode.py --spec 3         # speculative decoding: 3 query rows a sequence

On a GPU the shapes are DeepSeek V3.2's (H = 128, D = 576, top-k 2048,
caches of 8192 tokens) and the Triton kernels run; the example checks the
FP8 result against the same call on the dequantised cache (bf16 on a GPU),
and prints which backend served it. It then runs the step the way a server
does, through a plan made once (dsa.sparse_decode_plan) and called for every
layer, its outputs written into buffers of the engine's, and checks that each
layer's result is bitwise the function's.
"""

from __future__ import annotations

import argparse

import torch

import dsa

PAGE = 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--format", default="fp8_v32", choices=["fp8_v32", "fp8_model1"])
    p.add_argument("--spec", type=int, default=1, help="query rows a sequence")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    D = 576 if args.format == "fp8_v32" else 512
    B, H, K, cache_len = (32, 128, 2048, 8192) if cuda else (4, 16, 64, 512)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)

    # the engine's state: a pool of pages, each sequence's pages listed in its block-table row
    pages_per_seq = cache_len // PAGE
    pool = B * pages_per_seq + 7  # a few pages belong to no sequence
    latent = torch.randn(pool, PAGE, D, device=dev, generator=g)
    cache = dsa.quantize_kv_cache(latent, args.format)  # uint8 [pool, 64, 656 or 584]
    block_table = torch.randperm(pool, device=dev, generator=g)[: B * pages_per_seq].view(B, pages_per_seq).int()
    seq_lens = torch.randint(K, cache_len + 1, (B,), device=dev, generator=g).int()

    # this step: S query rows a sequence and their top-k positions (the indexer's job; random scores here)
    S = args.spec
    q = torch.randn(B, S, H, D, device=dev, generator=g).to(dtype)
    scores = torch.rand(B, S, cache_len, device=dev, generator=g)
    scores = scores.masked_fill(torch.arange(cache_len, device=dev) >= seq_lens.view(B, 1, 1), float("-inf"))
    positions, lengths = dsa.topk_indices(scores, K, return_lengths=True)  # [B, S, K], -1 padded
    sink = torch.randn(H, device=dev, generator=g)

    out, lse = dsa.sparse_decode(q, cache, positions, block_table=block_table, seq_lens=seq_lens,
                                 topk_length=lengths, sink=sink, return_lse=True)
    print(dsa.explain("sparse_decode", q, cache, positions, block_table=block_table, seq_lens=seq_lens,
                      topk_length=lengths, sink=sink))

    # the same step on the dequantised cache (exact in bf16), paged [pool, 64, 1, D]
    deq = dsa.dequantize_kv_cache(cache, args.format).to(dtype)[:, :, None]
    ref = dsa.sparse_decode(q, deq, positions, block_table=block_table, seq_lens=seq_lens, topk_length=lengths,
                            sink=sink)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}; relative L2 against the dequantised cache: "
          f"{err:.2e}")
    assert err < 1e-2, err

    # serving: one plan for every layer of this batch shape (checks, backend choice and launch
    # parameters made once), called each step with that layer's cache and sink
    layers = 3
    caches = [cache] + [dsa.quantize_kv_cache(torch.randn(pool, PAGE, D, device=dev, generator=g), args.format)
                        for _ in range(layers - 1)]
    sinks = [torch.randn(H, device=dev, generator=g) for _ in range(layers)]
    plan = dsa.sparse_decode_plan(q, cache, positions, block_table=block_table, seq_lens=seq_lens,
                                  topk_length=lengths, sink=sink)
    out_buf = torch.empty(B, S, H, 512, device=dev, dtype=dtype)  # the engine's output buffer
    for layer in range(layers):
        plan(q, caches[layer], positions, block_table=block_table, seq_lens=seq_lens, topk_length=lengths,
             sink=sinks[layer], out=out_buf)
        exp = dsa.sparse_decode(q, caches[layer], positions, block_table=block_table, seq_lens=seq_lens,
                                topk_length=lengths, sink=sinks[layer])
        assert torch.equal(out_buf, exp), layer
    print(f"plan on '{plan.backend}': {layers} layers, each bitwise the function's result")


if __name__ == "__main__":
    main()
