"""benchmarks/moe_peers.py on two gloo ranks (the harness the 2-GPU MoE runs use): fsdp8 with
expert parallelism (ep 2) and torch FSDP2 without it train the same Qwen3-MoE steps from the same
initial weights; torchtitan's stack says why it cannot run here."""

import pytest

from tests.cli.benchmark_runs import torchrun_benchmark


def test_moe_stacks_of_the_peer_benchmark_agree(tmp_path):
    pytest.importorskip("transformers")
    results = torchrun_benchmark("moe_peers.py", ["--model", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "2",
                                                  "--stacks", "fsdp8-ep,fsdp8-ep-fp8-e4m3,fsdp2,torchtitan-ep",
                                                  "--out", tmp_path / "moe.json"], tmp_path)
    ep, fp8, fsdp2 = results["fsdp8-ep"], results["fsdp8-ep-fp8-e4m3"], results["fsdp2"]
    assert [r["status"] for r in (ep, fp8, fsdp2)] == ["ok"] * 3, [r["error"] for r in (ep, fp8, fsdp2)]
    assert ep["mesh"] == fp8["mesh"] == "2 (ep 2)" and fsdp2["mesh"] == "2 (ep 1)"
    assert len(ep["losses"]) == 3
    # bf16 compute both ways, the same weights and tokens: the losses (about 5.5) part by bf16
    # rounding of the logits only, under 2e-3; FP8 operands (e4m3: 2**-4 relative per element,
    # averaging out over the sums) keep the loss within 2e-2 of bf16.
    for a, b, c in zip(ep["losses"], fsdp2["losses"], fp8["losses"]):
        assert abs(a - b) < 2e-3 and abs(c - a) < 2e-2
    assert ep["losses"] != fp8["losses"]  # the FP8 stack did quantize
    assert results["torchtitan-ep"]["status"] == "skipped" and "CUDA only" in results["torchtitan-ep"]["note"]
