"""``fsdp8 plan``, the command: the planner's prediction for one configuration, or with --search
every configuration that fits, fastest first, as a table or JSON."""

from __future__ import annotations

import argparse
import json

from ..planner import plan, search
from ..planner.candidates import fixes
from ..planner.hardware import GPUS, gpu_named
from ..planner.predict import plan_setup
from .args import fail, given, layout_flags, model_flags, parallel_from_flags, sizes


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory, communication and speed on a cluster",
                       description="Predict memory per rank (persistent memory exactly as memory_report() counts it), "
                                   "communication per step and step time of training a Llama-family model on a cluster, "
                                   "or with --search rank every configuration that fits. docs/PLANNING.md has the model.")
    model_flags(p, None, ": reads its config.json")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU of the table (default: %(default)s)")
    for name, unit in (("gpu-memory", "GiB"), ("bf16-tflops", "TFLOP/s"), ("fp8-tflops", "TFLOP/s"),
                       ("hbm-gbps", "GB/s"), ("nvlink-gbps", "GB/s each way"), ("network-gbps", "GB/s each way")):
        p.add_argument(f"--{name}", type=float, help=f"replace the GPU's figure, in {unit} (default: the table's)")
    p.add_argument("--nodes", type=int, default=1, help="machines (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per machine (default: %(default)s)")
    p.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step (default: micro batch x data-parallel ranks; --search: one per GPU)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="compute dtype (default: %(default)s)")
    layout_flags(p)
    p.add_argument("--search", action="store_true",
                   help="rank every configuration that fits (strategies, HSDP, tp, AC, micro batch, offload, and ep for "
                        "a mixture of experts) instead; with --cp N also every context-parallel degree dividing N")
    p.add_argument("--top", type=int, default=10, help="configurations --search prints (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    try:
        gpu = gpu_named(args.gpu, memory_gib=args.gpu_memory, bf16_tflops=args.bf16_tflops, fp8_tflops=args.fp8_tflops,
                        hbm_gbps=args.hbm_gbps, nvlink_gbps=args.nvlink_gbps, network_gbps=args.network_gbps)
        common = dict(gpu=gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, seq_len=given(args.seq_len, 2048),
                      global_batch=args.global_batch, **sizes(args))
        if args.search:
            # The search lays out every configuration itself: of the layout flags it takes the
            # precision, the FP8 recipe, --loss-parallel (wherever tp > 1) and with --cp N every
            # context-parallel degree that divides N (default 1: none); it weighs every ep itself.
            fixed = parallel_from_flags({"precision": args.precision, "fp8": args.fp8})
            cps = tuple(d for d in range(1, args.cp + 1) if args.cp % d == 0) or (args.cp,)  # (cp,): its error
            found = search(args.model, top=args.top, loss_parallel=args.loss_parallel, cps=cps,
                           precision=fixed.precision, fp8=fixed.fp8, **common)
        else:
            result = plan(args.model, parallel_from_flags(vars(args)), micro_batch=given(args.micro_batch, 1),
                          **common)
    except (ValueError, FileNotFoundError) as e:
        fail("plan", str(e))
    if args.search:
        print(json.dumps([dict(c.plan.to_dict(), rank=i + 1) for i, c in enumerate(found)], indent=2) if args.json
              else _search_table(found))
        return 0
    if args.json:
        print(json.dumps(dict(result.to_dict(), fixes=[] if result.memory.fits else fixes(result)), indent=2))
        return 0
    print(result)
    if not result.memory.fits:
        found = fixes(plan_setup(result.spec, result.setup))
        print("would fit with: " + "; ".join(found) if found else
              "no change of one or two settings makes it fit: try fsdp8 plan --search, or more --nodes")
    return 0


def _search_table(found) -> str:
    first = found[0].plan
    ep_column = "ep  " if first.spec.experts else ""  # a mixture of experts: its ep column
    lines = [f"fsdp8 plan --search: {first.spec.describe()}",
             f"  on {first.setup.cluster.describe()} = {first.setup.cluster.world} GPUs, seq {first.setup.seq_len}, "
             f"global batch {first.setup.global_batch}; the {len(found)} fastest distinct configurations that fit",
             f"{'#':>3} {'tokens/s/GPU':>12} {'MFU':>6} {'GiB':>6}  {'R x S x cp x tp':<16}{ep_column}"
             f"{'strategy':<19}{'outer':<9}{'AC':<10}{'offload':<8}{'SP':<4}{'micro x acc':>11}"]
    for i, c in enumerate(found, 1):
        p = c.parallel
        mesh = f"{p.dp_replicate}x{p.dp_shard}x{p.cp}x{p.tp}"
        ep = f"{p.ep:<4}" if ep_column else ""
        lines.append(f"{i:>3} {c.tokens_per_s_per_gpu:>12,.0f} {c.plan.mfu:>6.1%} {c.plan.memory.total / 2**30:>6.1f}  "
                     f"{mesh:<16}{ep}{p.strategy.label:<19}{p.outer_strategy.label:<9}{p.activation_checkpointing:<10}"
                     f"{p.offload or 'none':<8}{'yes' if p.sequence_parallel else 'no':<4}"
                     f"{f'{c.micro_batch} x {c.accumulation}':>11}")
    return "\n".join(lines)
