"""The plugin's step attention against vLLM's CPU attention (``cpu_attention_with_kv_cache``) on
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, blocks of 128): one
float32 cache per layer (30, so that each layer's keys and values come from memory as in an
engine), ``requests`` requests of ``context`` tokens each bringing ``tokens`` tokens (1 a plain
decode step, 1 + k verifying k drafts), every layer computed by both kernels (ours also on its
AVX2 blocks where the CPU has AVX-512), alternating ``--repeats`` times (best kept). Outputs are
compared.

    python benchmarks/step_attention.py --requests 1 8 --tokens 1 2 4 8 16 --context 600

Writes results/step_attention[_<tag>].json and prints milliseconds per step of 30 layers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time

from acceptance import RESULTS

from vllm_retrieval_spec.compat import configure_vllm_environment

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, LAYERS = 9, 3, 64, 128, 30


def step_times(requests: int, tokens: int, context: int, repeats: int) -> dict[str, float]:
    """Best milliseconds of one step's attention over all layers, per kernel, and their largest
    difference."""
    import torch
    from vllm import _custom_ops as ops

    from vllm_retrieval_spec import _C
    from vllm_retrieval_spec.kernels.attention import KVLayout, LayerAttention, tree_attention
    from vllm_retrieval_spec.verification.step_attention import chain_nodes

    seq_len = context + tokens
    width = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    caches = [torch.randn(requests * width, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE) for _ in range(LAYERS)]
    table = torch.arange(requests * width, dtype=torch.int32).view(requests, width)
    starts = torch.arange(0, requests * tokens + 1, tokens, dtype=torch.int32)
    seq_lens = torch.full((requests,), seq_len, dtype=torch.int32)
    query = torch.randn(requests * tokens, HEADS, HEAD_SIZE)
    wide = _C.use_wide_lanes(True)
    outputs = {name: torch.empty_like(query) for name in ("vllm", "plugin", "plugin_avx2")}
    scale = HEAD_SIZE ** -0.5
    schedule = ops.cpu_attn_get_scheduler_metadata(requests, HEADS, KV_HEADS, HEAD_SIZE, seq_lens, torch.float32,
                                                   starts, True, -1, "vec", True)
    nodes = chain_nodes(starts.numpy(), seq_lens.numpy(), table.numpy()).nodes
    attention = LayerAttention(HEADS, scale)

    def vllm_step() -> None:
        for cache in caches:
            keys, values = cache.view(cache.shape[0], KV_HEADS, 2 * BLOCK_SIZE, HEAD_SIZE).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(query, keys, values, outputs["vllm"], starts, seq_lens, scale, True,
                                            None, -1, table, 0.0, schedule, None)

    def plugin_step(name: str, wide_lanes: bool) -> None:
        _C.use_wide_lanes(wide_lanes)
        for cache in caches:
            tree_attention(query.view(len(query), -1), cache, outputs[name].view(len(query), -1), nodes,
                           KVLayout.CPU_VEC, attention)

    steps = {"vllm": vllm_step, "plugin": lambda: plugin_step("plugin", True)}
    if wide:  # the AVX-512 path against its AVX2 blocks (the same sums)
        steps["plugin_avx2"] = lambda: plugin_step("plugin_avx2", False)
    best = dict.fromkeys(steps, float("inf"))
    try:
        for _ in range(repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                best[name] = min(best[name], (time.perf_counter() - start) * 1000)
    finally:
        _C.use_wide_lanes(wide)
    best["max_difference"] = float((outputs["vllm"] - outputs["plugin"]).abs().max())
    if wide:
        best["avx2_blocks_equal"] = bool(torch.equal(outputs["plugin"], outputs["plugin_avx2"]))
    return best


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=600, help="tokens before each request's step")
    parser.add_argument("--repeats", type=int, default=7, help="steps per kernel and shape (best kept)")
    parser.add_argument("--tag", default="")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    configure_vllm_environment()
    rows = {(requests, tokens): step_times(requests, tokens, args.context, args.repeats)
            for requests, tokens in itertools.product(args.requests, args.tokens)}
    print(f"milliseconds per step of {LAYERS} layers, {args.context} tokens of context (best of {args.repeats})")
    print(f"{'requests':>8} {'tokens':>6} {'vLLM':>8} {'plugin':>8} {'ratio':>6} {'max diff':>9} "
          f"{'AVX2 blocks':>11} {'equal':>5}")
    for (requests, tokens), times in rows.items():
        avx2 = (f"{times['plugin_avx2']:>11.2f} {times['avx2_blocks_equal']!s:>5}" if "plugin_avx2" in times
                else f"{'-':>11} {'-':>5}")
        print(f"{requests:>8} {tokens:>6} {times['vllm']:>8.2f} {times['plugin']:>8.2f} "
              f"{times['vllm'] / times['plugin']:>6.2f} {times['max_difference']:>9.1e} {avx2}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"step_attention{'_' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps({
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE,
                  "layers": LAYERS, "context": args.context},
        "machine": platform.machine(), "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M"),
        "milliseconds_per_step": [{"requests": r, "tokens_per_request": t, **times} for (r, t), times in rows.items()],
    }, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
