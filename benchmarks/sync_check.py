"""Does a training step of an unmodified Hugging Face Llama under fsdp8.parallelize make the
host wait for the GPU? Run each step under ``torch.cuda.set_sync_debug_mode("error")``.

    python benchmarks/sync_check.py [--json FILE]          # CUDA only

transformers reads position ids on the host in two places (fsdp8/models/hf_adapter.py,
``skip_packed_sequence_check``): once per forward in its mask code, and in every layer of its
flash-attention path at batch size 1. Each row runs in its own process (the option replaces
the functions process-wide): attention "sdpa" or "flash_attention_2" (through
benchmarks/flash_attn_shim: this machine has no flash-attn; transformers' own code around the
kernel is what runs), the option off or on, with or without full activation checkpointing.
A row reports the first synchronising call it met (the error and the innermost frames of
fsdp8 or transformers), or none, and the step time with the debug mode off (median of 10
steps, batch 1 x 2048 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = [  # (attention, skip_packed_sequence_check, activation checkpointing)
    ("sdpa", False, "none"), ("sdpa", True, "none"),
    ("flash_attention_2", False, "none"), ("flash_attention_2", True, "none"), ("flash_attention_2", True, "full"),
]


def where(error: BaseException) -> list:
    """The innermost frames of the error's traceback that are fsdp8's or transformers' code."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "fsdp8" in f.filename or "transformers" in f.filename]
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}: {f.line}" for f in frames[-3:]]


def one(attention: str, skip: bool, ac: str) -> dict:
    sys.path.insert(0, str(ROOT))
    if attention == "flash_attention_2":
        sys.path.insert(0, str(ROOT / "benchmarks" / "flash_attn_shim"))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdp8

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, attn_implementation=attention)
    model = fsdp8.parallelize(model, fsdp8.ParallelConfig(skip_packed_sequence_check=skip,
                                                          activation_checkpointing=ac))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (1, 2048), device="cuda")

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        fsdp8.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        sync = None
    except RuntimeError as e:
        sync = {"error": str(e).splitlines()[0], "where": where(e)}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"attention": attention, "skip_packed_sequence_check": skip, "activation_checkpointing": ac,
            "step_ms": statistics.median(times) * 1e3, "sync": sync,
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here as JSON")
    p.add_argument("--one", nargs=3, metavar=("ATTENTION", "SKIP", "AC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        attention, skip, ac = args.one
        print(json.dumps(one(attention, skip == "1", ac)))
        return
    rows = []
    for attention, skip, ac in ROWS:
        run = subprocess.run([sys.executable, __file__, "--one", attention, str(int(skip)), ac],
                             capture_output=True, text=True)
        if run.returncode:
            rows.append({"attention": attention, "skip_packed_sequence_check": skip, "activation_checkpointing": ac,
                         "failed": run.stderr.strip().splitlines()[-5:]})
        else:
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    print(f"{'attention':<19}{'skip check':>11}{'AC':>6}{'step ms':>9}  first host synchronisation")
    for r in rows:
        if "failed" in r:
            print(f"{r['attention']:<19}{str(r['skip_packed_sequence_check']):>11}{r['activation_checkpointing']:>6}"
                  f"{'-':>9}  run failed: {r['failed'][-1]}")
            continue
        sync = "none" if r["sync"] is None else f"{r['sync']['error']} at {' <- '.join(reversed(r['sync']['where']))}"
        print(f"{r['attention']:<19}{str(r['skip_packed_sequence_check']):>11}{r['activation_checkpointing']:>6}"
              f"{r['step_ms']:>9.1f}  {sync}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
