"""FP8 linear vs bf16 nn.Linear, forward + backward, on transformer shapes (one GPU).

    python benchmarks/fp8_gemm.py [--tokens 4096] [--compile] [--out results.json]
        [--hidden 4096 --ffn 14336 --kv-dim 1024] [--recipes fp8-current,...] [--compile-only]

Shapes are a Llama layer's linears (default model B: hidden 4096, ffn 14336, 8 kv heads of
128; model A: --hidden 2048 --ffn 8192 --kv-dim 1024): for each,
forward+backward time (median of CUDA-event timings), TFLOP/s counting the three GEMMs
(6*M*K*N), and speedup over bf16. The FP8 time includes every quantization the layer does.
With --compile, each layer is also timed under torch.compile (bf16 and the traceable recipes),
where the quantization is generated and fused by the compiler instead of fsdp8's kernels.
"""

import argparse
import json
import statistics

import torch

from fsdp8.fp8.convert import convert_to_fp8
from fsdp8.fp8.recipes import recipe_from_name



def shapes(hidden: int, ffn: int, kv_dim: int):
    return [("q/o proj", hidden, hidden), ("k/v proj", hidden, kv_dim), ("gate/up", hidden, ffn), ("down", ffn, hidden)]

RECIPES = ["fp8-current", "fp8-delayed", "fp8-block", "fp8-mxfp8"]
COMPILED_RECIPES = ["fp8-current", "fp8-block"]


def time_layer(layer, x, dy, iters=20, warmup=5):
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = layer(x)
        y.backward(dy)
        end.record()
        for param in layer.parameters():
            param.grad = None
        x.grad = None
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--compile", action="store_true", help="also time compiled layers")
    p.add_argument("--out", default=None)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--kv-dim", type=int, default=1024)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of " + ", ".join(RECIPES))
    p.add_argument("--compile-only", action="store_true", help="time only compiled layers (bf16 and FP8)")
    args = p.parse_args()
    recipes = args.recipes.split(",")
    rows = []
    for name, k, n in shapes(args.hidden, args.ffn, args.kv_dim):
        torch.manual_seed(0)
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        flops = 6 * args.tokens * k * n
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        t_bf16 = time_layer(base, x, dy)
        rows.append({"shape": name, "K": k, "N": n, "recipe": "bf16", "ms": t_bf16, "tflops": flops / t_bf16 / 1e9, "speedup": 1.0})
        variants = [] if args.compile_only else [(recipe, False) for recipe in recipes]
        if args.compile or args.compile_only:
            variants += [("bf16", True)] + [(recipe, True) for recipe in recipes if recipe in COMPILED_RECIPES]
        for recipe, compiled in variants:
            layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            if recipe != "bf16":
                convert_to_fp8(layer, recipe_from_name(recipe))
            t = time_layer(torch.compile(layer) if compiled else layer, x, dy)
            label = recipe + (" + compile" if compiled else "")
            rows.append({"shape": name, "K": k, "N": n, "recipe": label, "ms": t, "tflops": flops / t / 1e9, "speedup": t_bf16 / t})
    print(f"\n## Float8Linear forward+backward vs bf16, M={args.tokens} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| shape | K x N | recipe | ms | TFLOP/s | speedup |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['K']}x{r['N']} | {r['recipe']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['speedup']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
