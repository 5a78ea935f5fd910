"""peers.py's report: the environment line, the markdown table and the JSON file (written
after every stack too, so a timeout keeps what finished)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # peers.py imports this module
    from peer_stacks import Context
    from peers import Result

FLOPS_FORMULA = (
    "FLOPs/token = 6*N + 12*L*H*S (N = all parameters incl. embedding and lm_head, L layers, H hidden, S seq)"
)


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def environment(ctx: Context) -> dict:
    import transformers

    import fsdp8

    env = {
        "fsdp8": str(Path(fsdp8.__file__).parent),  # which checkout ran (gpu_run.py ab runs two)
        "world_size": ctx.world,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_tflops": ctx.args.peak_tflops,
        "flops_formula": FLOPS_FORMULA,
        "timing": ("CUDA events per step, median; max over ranks" if ctx.device.type == "cuda"
                   else "perf_counter per step, median; max over ranks"),
        "memory": "torch.cuda.max_memory_{allocated,reserved} over warmup+timed steps, max over ranks",
        "warmup": ctx.args.warmup,
        "steps": ctx.args.steps,
        "hsdp_replicate": ctx.args.hsdp_replicate,
        "loopback": bool(ctx.args.loopback_world),
    }
    try:
        import megatron_fsdp

        env["megatron_fsdp"] = megatron_fsdp.__version__
    except Exception:
        env["megatron_fsdp"] = None
    return env


def markdown_table(results: list[Result]) -> str:
    head = ("| model | stack | mesh | tokens/s/GPU | step ms (median) | MFU | peak alloc GiB | peak reserved GiB "
            "| loss step 1 | loss last | notes |")
    rows = [head, "|" + "---|" * 11]
    for r in results:
        mfu = None if r.mfu is None else 100 * r.mfu
        note = r.note if r.status == "ok" else f"{r.status.upper()}: {r.note}"
        rows.append(
            f"| {r.model} | {r.stack} | {r.mesh or 'n/a'} | {fmt(r.tokens_per_s_per_gpu, ',.0f')} "
            f"| {fmt(r.step_ms_median, '.1f')} "
            f"| {fmt(mfu, '.1f')}{'%' if mfu is not None else ''} | {fmt(r.peak_alloc_gib, '.2f')} "
            f"| {fmt(r.peak_reserved_gib, '.2f')} | {fmt(r.loss_first, '.4f')} | {fmt(r.loss_last, '.4f')} "
            f"| {note} |"
        )
    return "\n".join(rows)


def print_report(env: dict, orders: dict, results: list[Result]) -> None:
    print(f"\n## peers: {env['world_size']} x {env['device']}, torch {env['torch']}, "
          f"transformers {env['transformers']}, megatron-fsdp {env['megatron_fsdp'] or 'not installed'}")
    print(f"- {env['flops_formula']}; MFU = tokens/s/GPU * FLOPs/token / ({env['peak_tflops']:g} TFLOP/s)")
    print(f"- timing: {env['timing']}, {env['warmup']} warmup + {env['steps']} timed steps")
    print(f"- memory: {env['memory']}")
    print(f"- mesh: data-parallel ranks; RxS = HSDP, R replicas of S-rank shard groups (--hsdp-replicate {env['hsdp_replicate']})")
    if env.get("loopback"):
        print(f"- LOOPBACK: one process plays rank 0 of {env['world_size']} on one device; collectives are local "
              "copies (fsdp8/app/bench/loopback.py): the world's step minus communication; losses are not a real model's")
    for model, order in orders.items():
        print(f"- run order: each stack over all models, stacks in turn: {' -> '.join(order)} (model {model})")
    print()
    print(markdown_table(results))
    for r in results:
        if r.memory_report:
            print(f"\n### {r.stack} memory_report, model {r.model}\n{r.memory_report}")
    sys.stdout.flush()


def write_json(path: str, env: dict, orders: dict, results: list[Result], complete: bool = True) -> None:
    """Write the results; `complete` is False for the partial files written after each stack."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "stack_order": orders, "complete": complete,
               "results": [asdict(r) for r in results]}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)  # a reader (or a timeout) never sees half a file
    if complete:
        print(f"\nwrote {out}")
