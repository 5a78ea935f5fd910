"""Experiment (issue 17): a block-scaled FP8 GEMM for Hopper in Gluon (Triton's explicit-layout
dialect), to see whether a kernel of our own could beat cuBLAS's sm90 blockwise GEMMs, which
leave Float8BlockScaling + compile at ~0.91x current scaling (docs/PERFORMANCE.md).

``a @ b.T`` for row-major FP8 ``a`` (M, K) and ``b`` (N, K) whose scales change every 128
elements of K: ``a`` has one fp32 ``scale_inv`` per row and 128-deep block (1x128), ``b``
one per row (1x128: the weight gradient) or one per 128x128 block (forward, input gradient).
Each 128-deep product is a wgmma into fresh registers; once done it is scaled by its row and
column scales and added to the fp32 sum on the CUDA cores (the promotion DeepSeek-V3
describes). Results equal cuBLAS's to the same error bound (gluon_block_gemm.py checks).

Variants (block_scaled_mm's arguments), and what they showed on an H200 (2026-11-26):
- keeping one MMA in flight across loop steps while the previous product is scaled: ptxas
  serializes every wgmma of such a kernel (C7514) and it ran at ~2x cuBLAS's time;
- ``unroll``: straight-line runs of 1, 2 or 4 blocks with two products taking turns (ptxas
  accepts this); ``warp_specialized``: a one-warp TMA producer; 64x128 tiles at 4 warps fit
  two programs an SM. All ran at 1.1-1.4x cuBLAS's blockwise time;
- ``plain`` (an unscaled GEMM on the same pipeline, wrong results by design) sets the speed
  limit of this structure: 1.2x cuBLAS's per-tensor time at 64x128, ~1.1x at 128x256 tiles,
  whose two fp32 tiles a thread (sum and product) do not fit the registers.
Beating cuBLAS would take a DeepGEMM-class kernel (ping-pong consumer warpgroups with ordered
MMAs, 128x256-class tiles); it is not in the library.

"""

from __future__ import annotations

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Triton, or one without Gluon
    gluon = None

SCALE_BLOCK = 128


if gluon is not None:

    @gluon.jit
    def _tile(M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, COMPACT: gl.constexpr,
              mma_layout: gl.constexpr, num_warps: gl.constexpr):
        """This program's output tile: its origin, and its row and column indices with their
        bounds (columns one a thread with COMPACT, else in the MMA layout). Tiles go in groups
        of GROUP_M rows so neighbouring programs share b in L2."""
        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BN)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = gl.minimum(gl.cdiv(M, BM) - first_m, GROUP_M)
        off_m = (first_m + (pid % per_group) % size_m) * BM
        off_n = ((pid % per_group) // size_m) * BN
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        if COMPACT:
            cols = off_n + gl.arange(0, BN, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        else:
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
        return off_m, off_n, rows, rows < M, cols, cols < N

    @gluon.jit
    def _issue_loads(kb, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES: gl.constexpr, pred):
        slot = kb % STAGES
        bar = bars.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, kb * SCALE_BLOCK_K], bar, a_bufs.index(slot), pred)
        tma.async_copy_global_to_shared(b_desc, [off_n, kb * SCALE_BLOCK_K], bar, b_bufs.index(slot), pred)

    SCALE_BLOCK_K = gl.constexpr(SCALE_BLOCK)

    @gluon.jit
    def _issue_mma(kb, regs, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES: gl.constexpr, num_k,
                   USE_ACC: gl.constexpr = False):
        # Refill the slot of block kb-2 (its MMA was seen finished when block kb-1's was issued)
        # with block kb+STAGES-2, then start block kb's product into ``regs`` (their values
        # ignored unless USE_ACC: the unscaled ablation accumulates).
        nxt = kb + STAGES - 2
        _issue_loads(nxt, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES, nxt < num_k)
        slot = kb % STAGES
        mbarrier.wait(bars.index(slot), (kb // STAGES) & 1)
        return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), regs, use_acc=USE_ACC,
                             is_async=True)

    @gluon.jit
    def _load_scales(kb, sa_ptr, sa_stride_m, sa_stride_k, rows, row_ok, sb_ptr, sb_stride_n, sb_stride_k, cols,
                     col_ok, off_n, B_ROWS: gl.constexpr, SCALAR_B: gl.constexpr):
        # Block kb's row scales and column scales (for 128x128 blocks one scalar: block_n is 128).
        sa = gl.load(sa_ptr + rows * sa_stride_m + kb * sa_stride_k, mask=row_ok, other=0.0)
        if SCALAR_B:  # the tile lies in one 128-row block of b
            sb = gl.load(sb_ptr + (off_n // B_ROWS) * sb_stride_n + kb * sb_stride_k)
        else:
            sb = gl.load(sb_ptr + (cols // B_ROWS) * sb_stride_n + kb * sb_stride_k, mask=col_ok, other=0.0)
        return sa, sb

    @gluon.jit
    def _add_scaled(acc, part, sa, sb, SCALAR_B: gl.constexpr, COMPACT: gl.constexpr):
        # acc += part * (sa (x) sb): the promotion of one 128-deep product into the fp32 sum.
        if SCALAR_B:  # one fused multiply-add an element
            out = gl.fma(part, (sa * sb)[:, None], acc)
        else:
            if COMPACT:
                # Loaded one column a thread, then spread to the MMA layout's columns (through shared
                # memory): loading straight into it holds an address per column a thread owns.
                sb = gl.convert_layout(sb, gl.SliceLayout(0, part.type.layout))
            # Each element's scale is made as it is used, so no tile of products is held.
            out = gl.fma(part, sa[:, None] * sb[None, :], acc)
        return out

    @gluon.jit
    def _block_scaled_mm_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
                                sa_stride_m, sa_stride_k, sb_stride_n, sb_stride_k,
                                B_ROWS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                                COMPACT: gl.constexpr,
                                UNROLL: gl.constexpr, PLAIN: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        SCALAR_B: gl.constexpr = B_ROWS > 1 and B_ROWS % BN == 0
        gl.static_assert(a_desc.block_type.shape[1] == SCALE_BLOCK_K)

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, BN, 32])
        off_m, off_n, rows, row_ok, cols, col_ok = _tile(M, N, BM, BN, GROUP_M, COMPACT, mma_layout, num_warps)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        num_k = gl.cdiv(K, SCALE_BLOCK_K)
        # Loads run STAGES-2 blocks ahead of the MMAs (see _issue_mma).
        for i in gl.static_range(STAGES - 2):
            _issue_loads(i, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES, i < num_k)

        # Each 128-deep product goes into fresh registers and is scaled by its row and column
        # scales into acc once its MMA is done. The scaling runs on the CUDA cores; MMAs keep the
        # tensor cores busy meanwhile from another program on the SM (two fit at 4 warps), and with
        # PAIRS from this one too: two blocks' MMAs are issued, then the first is scaled while the
        # second runs. (Keeping an MMA in flight across loop steps while scaling the previous
        # product made ptxas serialize every MMA of the kernel: C7514.)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        p = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        if UNROLL > 1:  # num_k is a multiple of UNROLL (block_scaled_mm checks)
            # Straight-line runs of UNROLL blocks: two products take turns, so while one block's
            # MMA runs, the block before it is scaled. Each run ends with no MMA in flight.
            q = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            for kb in range(0, num_k, UNROLL):
                p_run = _issue_mma(kb, p, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES, num_k)
                q_run = _issue_mma(kb + 1, q, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES, num_k)
                for j in gl.static_range(UNROLL):
                    sa, sb = _load_scales(kb + j, sa_ptr, sa_stride_m, sa_stride_k, rows, row_ok, sb_ptr, sb_stride_n,
                                          sb_stride_k, cols, col_ok, off_n, B_ROWS, SCALAR_B)
                    if j % 2 == 0:
                        p = warpgroup_mma_wait(num_outstanding=1 if j + 1 < UNROLL else 0, deps=(p_run, ))
                        acc = _add_scaled(acc, p, sa, sb, SCALAR_B, COMPACT)
                        if j + 2 < UNROLL:
                            p_run = _issue_mma(kb + j + 2, p, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs,
                                               STAGES, num_k)
                    else:
                        q = warpgroup_mma_wait(num_outstanding=1 if j + 1 < UNROLL else 0, deps=(q_run, ))
                        acc = _add_scaled(acc, q, sa, sb, SCALAR_B, COMPACT)
                        if j + 2 < UNROLL:
                            q_run = _issue_mma(kb + j + 2, q, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs,
                                               STAGES, num_k)
        elif PLAIN:  # ablation: an unscaled GEMM with this kernel's pipeline (its speed limit)
            run = warpgroup_mma_init(acc)
            for kb in range(num_k):
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(run, ))
                run = _issue_mma(kb, acc, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES, num_k, True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(run, ))
        else:
            # The next block's scales are loaded a step ahead, so their latency hides behind an MMA.
            sa_next, sb_next = _load_scales(0, sa_ptr, sa_stride_m, sa_stride_k, rows, row_ok, sb_ptr, sb_stride_n,
                                            sb_stride_k, cols, col_ok, off_n, B_ROWS, SCALAR_B)
            for kb in range(num_k):
                p_run = _issue_mma(kb, p, a_desc, b_desc, off_m, off_n, bars, a_bufs, b_bufs, STAGES, num_k)
                sa = sa_next
                sb = sb_next
                sa_next, sb_next = _load_scales(gl.minimum(kb + 1, num_k - 1), sa_ptr, sa_stride_m, sa_stride_k,
                                                rows, row_ok, sb_ptr, sb_stride_n, sb_stride_k, cols, col_ok, off_n,
                                                B_ROWS, SCALAR_B)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p_run, ))
                acc = _add_scaled(acc, p, sa, sb, SCALAR_B, COMPACT)

        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)


    @gluon.jit
    def _ws_load_partition(a_desc, b_desc, ready, empty, a_bufs, b_bufs, off_m, off_n, num_k, STAGES: gl.constexpr):
        # One warp keeps the ring full: a slot is refilled as soon as the MMA that read it is done.
        for kb in range(num_k):
            slot = kb % STAGES
            mbarrier.wait(empty.index(slot), ((kb // STAGES) & 1) ^ 1)  # a new barrier's phase 1 counts as done
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kb * SCALE_BLOCK_K], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [off_n, kb * SCALE_BLOCK_K], bar, b_bufs.index(slot))

    @gluon.jit
    def _ws_mma_partition(acc, ready, empty, a_bufs, b_bufs, num_k, sa_ptr, sa_stride_m, sa_stride_k, rows, row_ok,
                          sb_ptr, sb_stride_n, sb_stride_k, cols, col_ok, off_n, B_ROWS: gl.constexpr,
                          SCALAR_B: gl.constexpr, COMPACT: gl.constexpr, STAGES: gl.constexpr):
        p = gl.zeros_like(acc)
        sa_next, sb_next = _load_scales(0, sa_ptr, sa_stride_m, sa_stride_k, rows, row_ok, sb_ptr, sb_stride_n,
                                        sb_stride_k, cols, col_ok, off_n, B_ROWS, SCALAR_B)
        for kb in range(num_k):
            slot = kb % STAGES
            mbarrier.wait(ready.index(slot), (kb // STAGES) & 1)
            p_run = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), p, use_acc=False,
                                  is_async=True)
            sa = sa_next
            sb = sb_next
            sa_next, sb_next = _load_scales(gl.minimum(kb + 1, num_k - 1), sa_ptr, sa_stride_m, sa_stride_k, rows,
                                            row_ok, sb_ptr, sb_stride_n, sb_stride_k, cols, col_ok, off_n, B_ROWS,
                                            SCALAR_B)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p_run, ))
            mbarrier.arrive(empty.index(slot), count=1)
            acc = _add_scaled(acc, p, sa, sb, SCALAR_B, COMPACT)
        return (acc, )

    @gluon.jit
    def _block_scaled_mm_ws_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
                                   sa_stride_m, sa_stride_k, sb_stride_n, sb_stride_k,
                                   B_ROWS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                                   COMPACT: gl.constexpr, num_warps: gl.constexpr):
        # Warp-specialized: a one-warp partition issues the TMA loads, the kernel's warps run the
        # MMAs and the scaling; a second program on the SM fills the tensor cores while one scales.
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        SCALAR_B: gl.constexpr = B_ROWS > 1 and B_ROWS % BN == 0
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, BN, 32])
        off_m, off_n, rows, row_ok, cols, col_ok = _tile(M, N, BM, BN, GROUP_M, COMPACT, mma_layout, num_warps)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        num_k = gl.cdiv(K, SCALE_BLOCK_K)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        acc, = gl.warp_specialize([
            (_ws_mma_partition, (acc, ready, empty, a_bufs, b_bufs, num_k, sa_ptr, sa_stride_m, sa_stride_k, rows,
                                 row_ok, sb_ptr, sb_stride_n, sb_stride_k, cols, col_ok, off_n, B_ROWS, SCALAR_B,
                                 COMPACT,
                                 STAGES)),
            (_ws_load_partition, (a_desc, b_desc, ready, empty, a_bufs, b_bufs, off_m, off_n, num_k, STAGES)),
        ], [1], [40])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)


def block_scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_rows: int = 1,
                    out_dtype: torch.dtype = torch.bfloat16, block_m: int = 128, block_n: int = 128,
                    stages: int = 4, num_warps: int = 8, group_m: int = 8, compact: bool = True,
                    unroll: int = 1, warp_specialized: bool = False, maxnreg=None,
                    plain: bool = False) -> torch.Tensor:
    """``a @ b.T`` with 128-deep K-block scales (see the module doc); ``sa`` is (M, K/128),
    ``sb`` (N, K/128) for ``b_rows=1`` or (N/128, K/128) for ``b_rows=128``, any strides."""
    m, k = a.shape
    n = b.shape[0]
    if k % SCALE_BLOCK or b.shape[1] != k:
        raise ValueError(f"block_scaled_mm: a {tuple(a.shape)} and b {tuple(b.shape)} need one K, a multiple of 128")
    if tuple(sa.shape) != (m, k // SCALE_BLOCK) or tuple(sb.shape) != (-(-n // b_rows), k // SCALE_BLOCK):
        raise ValueError(f"block_scaled_mm: scales {tuple(sa.shape)} and {tuple(sb.shape)} do not fit a "
                         f"{tuple(a.shape)}, b {tuple(b.shape)} with b_rows={b_rows}")
    if b_rows not in (1, 128):
        raise ValueError("block_scaled_mm: b_rows is 1 (1x128 scales) or 128 (128x128)")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    fp8 = gl.float8e4nv if a.dtype == torch.float8_e4m3fn else gl.float8e5
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, SCALE_BLOCK], fp8)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, SCALE_BLOCK], gl.float8e4nv
                                                    if b.dtype == torch.float8_e4m3fn else gl.float8e5)
    c_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_n], gl.bfloat16 if out_dtype == torch.bfloat16
                                                    else gl.float32)
    a_desc = TensorDescriptor.from_tensor(a, [block_m, SCALE_BLOCK], a_layout)
    b_desc = TensorDescriptor.from_tensor(b, [block_n, SCALE_BLOCK], b_layout)
    c_desc = TensorDescriptor.from_tensor(c, [block_m, block_n], c_layout)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), )
    args = (a_desc, b_desc, c_desc, sa, sb, m, n, k, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    if warp_specialized:
        _block_scaled_mm_ws_kernel[grid](*args, B_ROWS=b_rows, STAGES=stages, GROUP_M=group_m,
                                         COMPACT=compact and b_rows == 1, num_warps=num_warps, **options)
    else:
        fitting = next(u for u in (8, 4, 2, 1) if u <= unroll and (k // SCALE_BLOCK) % u == 0)
        _block_scaled_mm_kernel[grid](*args, B_ROWS=b_rows, STAGES=stages, GROUP_M=group_m,
                                      COMPACT=compact and b_rows == 1, UNROLL=fitting,
                                      PLAIN=plain, num_warps=num_warps, **options)
    return c
