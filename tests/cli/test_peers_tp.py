"""benchmarks/peers.py's tensor-parallel stacks on two gloo ranks (the harness the 2-GPU runs use):
fsdp8 and torch FSDP2 over the same torch TP styles (sequence parallel, tp 2) train the same
steps. With one data-parallel rank nothing is reduced, both compute the same forward from the
same bf16 compute weights and step the same fp32 AdamW, so their losses agree to the JSON's
five decimals; a gradient either engine got wrong (a replicated norm's, say) would part them
by the second step."""

import json
import subprocess
import sys

import pytest

from tests.cli.benchmark_runs import REPO, torchrun_benchmark


def test_tp_stacks_of_the_peer_benchmark_agree(tmp_path):
    pytest.importorskip("transformers")
    results = torchrun_benchmark("peers.py", ["--models", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "3",
                                              "--stacks", "fsdp8-tp,fsdp2-tp,torchao-tp-fp8",
                                              "--out", tmp_path / "peers.json"], tmp_path)
    fsdp8_tp, fsdp2_tp = results["fsdp8-tp"], results["fsdp2-tp"]
    assert (fsdp8_tp["status"], fsdp2_tp["status"]) == ("ok", "ok"), (fsdp8_tp["error"], fsdp2_tp["error"])
    assert fsdp8_tp["mesh"] == fsdp2_tp["mesh"] == "1 dp x 2 tp"
    assert len(fsdp8_tp["losses"]) == 4 and fsdp8_tp["losses"] == fsdp2_tp["losses"]
    assert fsdp8_tp["losses"][-1] < fsdp8_tp["losses"][0]  # it trains
    # The host's figures over the timed steps (a slow host tells itself from a slow GPU).
    host = fsdp8_tp["host"]
    assert set(host) == {"cpu_ms_per_step", "gc_collections", "loadavg_1min"} and host["cpu_ms_per_step"] > 0
    # The torchao FP8 TP peer says why it cannot run on gloo instead of failing.
    assert results["torchao-tp-fp8"]["status"] == "skipped" and "CUDA only" in results["torchao-tp-fp8"]["note"]


def test_compiled_fp8_tp_stack_of_the_peer_benchmark(tmp_path):
    # The compiled FP8 TP stack (its linears traced into each compiled layer) trains, and
    # --host-profile writes every rank's profile: the slowest host, not rank 0's, sets a
    # collective-bound step. --gc-every 2: over the 3 timed steps the only collection is the one
    # made after step 2 (automatic collection is off).
    pytest.importorskip("transformers")
    host = tmp_path / "host"
    [result] = torchrun_benchmark("peers.py", ["--models", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "3",
                                               "--stacks", "fsdp8-tp-fp8-compile", "--out", tmp_path / "peers.json",
                                               "--host-profile", host, "--gc-every", "2"], tmp_path, timeout=600).values()
    assert result["status"] == "ok" and result["mesh"] == "1 dp x 2 tp", result["error"]
    assert result["host"]["gc_collections"] == 1, result["host"]
    assert result["losses"][-1] < result["losses"][0]
    profiles = sorted(p.name for p in host.iterdir())
    # The text tables, and the raw pstats for comparing two stacks offline.
    assert profiles == [f"tiny-fsdp8-tp-fp8-compile-host-rank{r}.{ext}" for r in (0, 1) for ext in ("pstats", "txt")]
    import pstats

    assert any("train_step" in func for _, _, func in pstats.Stats(str(host / profiles[0])).stats), profiles


def test_tp_full_batch_gives_each_gpu_a_data_parallel_ranks_tokens():
    # --tp-full-batch: a TP group of 2 trains 2 micro-batches, so each GPU's share of tokens is a
    # dp rank's; without it the group trains one and each GPU half as many.
    code = ("import argparse, peers; ctx = argparse.Namespace(args=argparse.Namespace(tp_full_batch={}));"
            "print(peers.group_rows(peers.MODELS['B'], ctx, 2), peers.group_rows(peers.MODELS['B'], ctx, 1))")
    rows = [subprocess.run([sys.executable, "-c", code.format(full)], cwd=REPO / "benchmarks", capture_output=True,
                           text=True, timeout=120) for full in (False, True)]
    assert [r.stdout.split() for r in rows] == [["2", "2"], ["4", "2"]], [r.stderr[-2000:] for r in rows]


def test_inductor_settings_of_the_peer_benchmark():
    """``peers.py --inductor``: key=value items, 0/1 as booleans, integers as ints; a bare key is refused.
    Asked of the script's module from benchmarks/, where it runs (its sibling modules are found there)."""
    def parsed(text: str) -> subprocess.CompletedProcess:
        code = f"import json, peers; print(json.dumps(peers.inductor_settings({text!r})))"
        return subprocess.run([sys.executable, "-c", code], cwd=REPO / "benchmarks", capture_output=True, text=True,
                              timeout=120)

    got = parsed("triton.tile_reductions=1,max_autotune=0,realize_reads_threshold=4,mode=x,")
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout) == {"triton.tile_reductions": True, "max_autotune": False,
                                      "realize_reads_threshold": 4, "mode": "x"}
    refused = parsed("triton.tile_reductions")
    assert refused.returncode == 1 and "key=value" in refused.stderr, refused.stderr[-3000:]
