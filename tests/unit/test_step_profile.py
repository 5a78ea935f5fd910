"""The step-profile arithmetic (fsdp8/app/bench/step_profile.py) on hand-made kernel timelines."""

import pytest

from fsdp8.app.bench.step_profile import Kernel, category, kernels_from_chrome_trace, merge_intervals, summarize


def test_merge_intervals_joins_overlaps_and_touching_ends():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (10, 11)]) == [(0, 4), (5, 7), (10, 11)]


def test_categories_put_nccl_first():
    assert category("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "comm"
    assert category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert category("triton_per_fused_abs_amax_0") == "triton"
    assert category("triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_7") == "triton"  # not a GEMM
    assert category("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128") == "gemm"
    assert category("flash_fwd_kernel") == "attention"
    assert category("multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert category("CatArrayBatchedCopy") == "copy"
    assert category("vectorized_elementwise_kernel") == "other"


def test_summary_splits_window_into_compute_exposed_comm_and_idle():
    kernels = [
        Kernel("gemm_a", 0, 40, stream=7),
        Kernel("ncclAllGather", 10, 60, stream=20),  # 40..60 exposed
        Kernel("triton_fused", 70, 90, stream=7),  # 60..70 idle
        Kernel("ncclReduceScatter", 85, 100, stream=20),  # 90..100 exposed
        Kernel("gemm_a", 100, 120, stream=7),
    ]
    s = summarize(kernels)
    assert s["window_ms"] == pytest.approx(0.120)
    assert s["compute_ms"] == pytest.approx(0.080)
    assert s["exposed_comm_ms"] == pytest.approx(0.030)
    assert s["idle_ms"] == pytest.approx(0.010)
    assert s["comm_ms"] == pytest.approx(0.065)
    assert s["streams"] == 2
    assert s["costliest"][0] == {"name": "gemm_a", "ms": pytest.approx(0.060), "count": 2}
    assert s["per_category_ms"]["comm"] == pytest.approx(0.065)


def test_summary_refuses_an_empty_profile():
    with pytest.raises(ValueError, match="no device kernels"):
        summarize([])


def test_chrome_trace_keeps_device_kernels_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 10.0, "dur": 5.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 9.0, "dur": 1.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 20.0, "dur": 2.0, "args": {"stream": 8}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0},
    ]}
    assert kernels_from_chrome_trace(trace) == [Kernel("k1", 10.0, 15.0, 7), Kernel("Memcpy DtoD", 20.0, 22.0, 8)]
