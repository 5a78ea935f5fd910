"""One compiled HF Llama decoder layer (model B sizes, or --hidden/--ffn/--heads/--kv-heads), forward + backward on one GPU: bf16,
fsdp8 FP8 current scaling (traced), torchao float8 tensorwise. No sharding, so the numbers
separate the layer's compute from the engine's. Prints time, peak memory, what autograd saves
for backward (grouped by shape and dtype) and the top CUDA kernels of each.

    python benchmarks/debug/fp8_layer_profile.py [--tokens 4096] [--top 12]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


SIZES = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)


def build_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**SIZES,
                      num_hidden_layers=1, vocab_size=32000, max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).cuda().to(torch.bfloat16)
    return layer, LlamaRotaryEmbedding(cfg).cuda(), cfg


def convert(layer, kind):
    if kind.startswith("fsdp8-fp8-"):  # fsdp8-fp8-current, -block, -delayed, -mxfp8
        import fsdp8
        from fsdp8.fp8.recipes import recipe_from_name

        fsdp8.convert_to_fp8(layer, recipe_from_name(kind[len("fsdp8-"):]))
    elif kind == "torchao-float8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(layer)
    return layer


def run(kind, tokens, top):
    layer, rotary, cfg = build_layer()
    layer = convert(layer, kind)
    fwd = torch.compile(layer)
    seq = 2048
    x = torch.randn(tokens // seq, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device="cuda")[None].expand(x.shape[0], -1)
    emb = rotary(x, pos)

    def step():
        out = fwd(x, position_embeddings=emb, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in times)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print_saved(layer, lambda: fwd(x, position_embeddings=emb, position_ids=pos), kind)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"\n## {kind}: {ms:.3f} ms fwd+bwd, activation peak {peak:.2f} GiB over weights", flush=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)
    print(table, flush=True)


def print_saved(layer, forward, kind):
    """What one forward saves for backward, parameters excluded, each storage counted once."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    print(f"\n## {kind}: one forward leaves {(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB allocated "
          f"(its output and what it saves)", flush=True)
    del out
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen, groups = set(), {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            key = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
            count, nbytes = groups.get(key, (0, 0))
            groups[key] = (count + 1, nbytes + t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    total = sum(b for _, b in groups.values())
    print(f"## {kind}: saved for backward {total / 2**20:.1f} MiB in {len(seen)} storages", flush=True)
    for (shape, dtype), (count, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"  {count} x {dtype} {list(shape)}: {nbytes / 2**20:.1f} MiB")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--kinds", default="bf16,fsdp8-fp8-current,torchao-float8")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--inductor", default="", help="torch._inductor.config settings, as benchmarks/peers.py takes them")
    args = p.parse_args()
    if args.inductor:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from peers import inductor_settings

        torch._inductor.config.load_config(inductor_settings(args.inductor))
    SIZES.update(hidden_size=args.hidden, intermediate_size=args.ffn, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, tokens {args.tokens}")
    for kind in args.kinds.split(","):
        try:
            run(kind, args.tokens, args.top)
        except Exception as err:  # report and go on
            print(f"\n## {kind}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
