"""Weak-scaling table from several benchmarks/peers.py JSON files (one per GPU count).

    python benchmarks/scaling.py runs/peers2.json runs/peers4.json [--base 2] [--out scaling.md]

Each file's environment.world_size is its GPU count; the per-GPU work is fixed (same model,
micro-batch and sequence per rank), so this is weak scaling. Efficiency of a stack at N GPUs
= its tokens/s/GPU at N over the same stack's (same model) tokens/s/GPU at --base GPUs.
A second table puts each HSDP stack next to its flat peer at the same GPU count
(fsdp8-hsdp-* against fsdp8, fsdp2-hsdp against fsdp2). Missing files, missing stacks and
stacks that were skipped or failed show as n/a (with the reason) instead of stopping the
report; partial files (a run cut off by its timeout) are used as far as they go.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# HSDP stack -> the flat stack it is compared with at the same GPU count.
FLAT_PEER = {"fsdp8-hsdp-noshard": "fsdp8", "fsdp8-hsdp-optim": "fsdp8", "fsdp2-hsdp": "fsdp2"}


def scaling_efficiency(tokens_per_s_per_gpu: float | None, base_tokens_per_s_per_gpu: float | None) -> float | None:
    """Weak-scaling efficiency: per-GPU throughput at N over per-GPU throughput at the base
    count; None when either is missing or the base is not positive. 1.0 = perfect."""
    if tokens_per_s_per_gpu is None or base_tokens_per_s_per_gpu is None or base_tokens_per_s_per_gpu <= 0:
        return None
    return tokens_per_s_per_gpu / base_tokens_per_s_per_gpu


def load_runs(paths: list[str]) -> tuple[dict, list[str]]:
    """{(model, stack, gpus): result dict} over all files (a later file wins a repeated key),
    and warnings about files that are missing, unreadable or incomplete."""
    rows, warnings = {}, []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
            gpus = int(payload["environment"]["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            warnings.append(f"{path}: not read ({type(err).__name__}: {err})")
            continue
        if payload.get("complete") is False:
            warnings.append(f"{path}: partial (the run stopped early); its finished stacks are used")
        for r in payload.get("results", []):
            key = (r.get("model"), r.get("stack"), gpus)
            if key in rows:
                warnings.append(f"{path}: {key[0]} {key[1]} at {gpus} GPUs repeated; this file's result is used")
            rows[key] = r
    return rows, warnings


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok" and r.get("tokens_per_s_per_gpu") is not None


def _tps(r: dict | None) -> float | None:
    return r["tokens_per_s_per_gpu"] if _ok(r) else None


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def _order(rows: dict) -> tuple[list, list, list]:
    """Models, stacks (first-seen order) and GPU counts (ascending) present in `rows`."""
    models, stacks = [], []
    for model, stack, _ in rows:
        if model not in models:
            models.append(model)
        if stack not in stacks:
            stacks.append(stack)
    return models, stacks, sorted({g for _, _, g in rows})


def scaling_table(rows: dict, base: int) -> str:
    """One row per (model, stack, GPUs) that ran or failed; skipped ones are listed below it."""
    models, stacks, gpu_counts = _order(rows)
    skipped = []
    out = ["| model | stack | mesh | GPUs | tokens/s/GPU | MFU | peak alloc GiB | "
           f"efficiency vs {base} GPUs | notes |", "|" + "---|" * 9]
    for model in models:
        for stack in stacks:
            base_r = rows.get((model, stack, base))
            for gpus in gpu_counts:
                r = rows.get((model, stack, gpus))
                if r is None:
                    continue
                if r.get("status") == "skipped":
                    skipped.append(f"- not run: {model} {stack} at {gpus} GPUs: {r.get('note') or 'skipped'}")
                    continue
                mfu = r.get("mfu")
                eff = scaling_efficiency(_tps(r), _tps(base_r))
                if eff is not None:
                    eff_text = f"{100 * eff:.1f}%"
                elif not _ok(r):
                    eff_text = "n/a"
                elif base_r is None:
                    eff_text = f"n/a (no {base}-GPU run)"
                else:
                    eff_text = f"n/a ({base}-GPU run {base_r.get('status')})"
                note = r.get("note") or ""
                if r.get("status") != "ok":
                    note = f"{str(r.get('status')).upper()}: {note}"
                out.append(
                    f"| {model} | {stack} | {r.get('mesh') or 'n/a'} | {gpus} | {_fmt(_tps(r), ',.0f')} "
                    f"| {_fmt(None if mfu is None else 100 * mfu, '.1f', '%')} | {_fmt(r.get('peak_alloc_gib'), '.2f')} "
                    f"| {eff_text} | {note} |"
                )
    return "\n".join(out + ([""] + skipped if skipped else []))


def hsdp_table(rows: dict) -> str | None:
    """HSDP stacks against their flat peer at the same GPU count; None when no HSDP stack ran."""
    out = ["| model | GPUs | stack | mesh | tokens/s/GPU | flat stack | flat tokens/s/GPU | HSDP / flat "
           "| peak alloc GiB (HSDP / flat) | loss step 1 (HSDP / flat) |", "|" + "---|" * 10]
    found = False
    for (model, stack, gpus), r in rows.items():
        if stack not in FLAT_PEER or not _ok(r):
            continue
        found = True
        flat_name = FLAT_PEER[stack]
        flat = rows.get((model, flat_name, gpus))
        ratio = scaling_efficiency(_tps(r), _tps(flat))
        out.append(
            f"| {model} | {gpus} | {stack} | {r.get('mesh') or 'n/a'} | {_fmt(_tps(r), ',.0f')} | {flat_name} "
            f"| {_fmt(_tps(flat), ',.0f')} | {_fmt(ratio, '.3f')} "
            f"| {_fmt(r.get('peak_alloc_gib'), '.2f')} / {_fmt((flat or {}).get('peak_alloc_gib') if _ok(flat) else None, '.2f')} "
            f"| {_fmt(r.get('loss_first'), '.5f')} / {_fmt((flat or {}).get('loss_first') if _ok(flat) else None, '.5f')} |"
        )
    return "\n".join(out) if found else None


def report(paths: list[str], base: int) -> str:
    rows, warnings = load_runs(paths)
    parts = [f"## weak scaling ({', '.join(paths)})", "",
             "Per-GPU work fixed (same model, micro-batch and sequence per rank); "
             f"efficiency = tokens/s/GPU at N / tokens/s/GPU of the same stack at {base} GPUs.", ""]
    parts += [f"- warning: {w}" for w in warnings]
    if warnings:
        parts.append("")
    if not rows:
        parts.append("no results")
        return "\n".join(parts)
    parts.append(scaling_table(rows, base))
    hsdp = hsdp_table(rows)
    if hsdp is not None:
        parts += ["", "### HSDP against flat FSDP at the same GPU count", "", hsdp]
    return "\n".join(parts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="peers.py JSON files, one per GPU count")
    p.add_argument("--base", type=int, default=2, help="GPU count the efficiency is relative to")
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args(argv)
    text = report(args.files, args.base)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
