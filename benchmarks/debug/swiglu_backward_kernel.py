"""Experiment: other forms of the fused SwiGLU backward of fsdp8/fp8/swiglu.py
(which has the values, the outputs and the two passes fsdp8 uses), kept with their numbers
(docs/PERFORMANCE.md, 2026-11-26 third session; benchmarks/debug/swiglu_backward_kernels.py):

- ``_swiglu_backward_kernel``: one 128x128 tile a program, each tile's three outputs (h by
  columns; du and dg both ways) three programs launched next to one another, so their shared
  inputs come from L2. It holds a whole tile: 192-255 registers, 0.62 ms at best for model
  A's 8192 x 8192 against the two passes' 0.46;
- ``_swiglu_reread_kernel``: both passes in one program, the second reading the tile from
  L2: 255 registers, 1.5-2.3 ms.
"""

from __future__ import annotations

import torch

from fsdp8.fp8.swiglu import SwiGLUGrads, swiglu_backward_reference  # noqa: F401

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds of torch
    triton = None

if triton is not None:
    from fsdp8.fp8.swiglu import swiglu_backward_outputs, two_passes  # noqa: F401
    from fsdp8.fp8.swiglu import _abs_bits, _bits_amax, _cast_tile, _col_amaxes, _over_one_plus_exp
    from fsdp8.fp8.triton_kernels import _clamp_cast, _reciprocal, _scale_from_amax

    @triton.jit
    def _store_cols(x, qt_ptr, st_ptr, rm, rn, M, mb, FMAX: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr):
        # 128x1 blocks down the tile's columns, written transposed: 1x128 blocks of x.t().
        col_scale = _scale_from_amax(_bits_amax(_abs_bits(x), x.dtype, 0), FMAX)
        q = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT, SATURATE)
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q))
        tl.store(st_ptr + rn * (M // 128) + mb, _reciprocal(col_scale))

    @triton.jit
    def _store_both(x, q_ptr, s_ptr, qt_ptr, st_ptr, rm, rn, M, N, mb, nb, FMAX: tl.constexpr, OUT: tl.constexpr,
                    SATURATE: tl.constexpr):
        row_scale = _scale_from_amax(_bits_amax(_abs_bits(x), x.dtype, 1), FMAX)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT,
                                                                    SATURATE))
        tl.store(s_ptr + rm * (N // 128) + nb, _reciprocal(row_scale))
        _store_cols(x, qt_ptr, st_ptr, rm, rn, M, mb, FMAX, OUT, SATURATE)

    @triton.jit
    def _swiglu_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr, dut_s,
                                ht_ptr, ht_s, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr,
                                SATURATE: tl.constexpr, EXACT: tl.constexpr = False):
        B: tl.constexpr = 128
        GMAX: tl.constexpr = 57344.0 if GRAD_E5M2 else 448.0
        GOUT: tl.constexpr = tl.float8e5 if GRAD_E5M2 else tl.float8e4nv
        HMAX: tl.constexpr = 57344.0 if FWD_E5M2 else 448.0
        HOUT: tl.constexpr = tl.float8e5 if FWD_E5M2 else tl.float8e4nv
        # Each tile's three outputs are three programs, launched next to one another (the
        # output is the grid's fastest index), so the inputs they share come from L2 after the
        # first read. One program making all three held three tiles: 255 registers at 8
        # warps, 0.89 ms at best for model A's 8192 x 8192 (exact maths), against 0.90 for this.
        which, tile = tl.program_id(0), tl.program_id(1)
        mb, nb = tile // (N // B), tile % (N // B)
        rm = mb * B + tl.arange(0, B)
        rn = nb * B + tl.arange(0, B)
        offs = rm[:, None] * N + rn[None, :]
        dt = g_ptr.dtype.element_ty
        if which == 0:
            # h = silu(g) * u for down's weight gradient, each op rounded as eager rounds it,
            # with torch's CUDA formula for silu.
            g = tl.load(g_ptr + offs).to(tl.float32)
            a = _over_one_plus_exp(g, g, EXACT).to(dt).to(tl.float32)
            h = (a * tl.load(u_ptr + offs).to(tl.float32)).to(dt)
            _store_cols(h, ht_ptr, ht_s, rm, rn, M, mb, HMAX, HOUT, SATURATE)
        elif which == 1:
            g = tl.load(g_ptr + offs).to(tl.float32)
            a = _over_one_plus_exp(g, g, EXACT).to(dt).to(tl.float32)
            du = (tl.load(dh_ptr + offs).to(tl.float32) * a).to(dt)
            _store_both(du, du_ptr, du_s, dut_ptr, dut_s, rm, rn, M, N, mb, nb, GMAX, GOUT, SATURATE)
        else:
            # dg = silu_backward(dh * u, g), torch's CUDA formula.
            da = (tl.load(dh_ptr + offs).to(tl.float32) * tl.load(u_ptr + offs).to(tl.float32)).to(dt).to(tl.float32)
            g = tl.load(g_ptr + offs).to(tl.float32)
            s = _over_one_plus_exp(g * 0.0 + 1.0, g, EXACT)
            dg = (da * s * (1.0 + g * (1.0 - s))).to(dt)
            _store_both(dg, dg_ptr, dg_s, dgt_ptr, dgt_s, rm, rn, M, N, mb, nb, GMAX, GOUT, SATURATE)

    @triton.jit
    def _swiglu_reread_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr, dut_s, ht_ptr,
                              ht_s, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr, SATURATE: tl.constexpr,
                              R: tl.constexpr, EXACT: tl.constexpr):
        """Both passes in one program: the tile's second read comes from L2 (96 KB just read)."""
        mb, nb = tl.program_id(0), tl.program_id(1)
        rn = nb * 128 + tl.arange(0, 128)
        h_max, du_max, dg_max = _col_amaxes(dh_ptr, g_ptr, u_ptr, mb, rn, N, R, EXACT)
        _cast_tile(dh_ptr, g_ptr, u_ptr, h_max, du_max, dg_max, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                   dut_s, ht_ptr, ht_s, mb, nb, rn, M, N, GRAD_E5M2, FWD_E5M2, SATURATE, R, EXACT)
