"""All experts' FP8 GEMMs in one grouped kernel: ``torch._scaled_grouped_mm`` where it runs (Hopper),
and an exact emulation of it elsewhere, so that CPU runs cover the layouts and scales it is fed.

[Note: FP8 experts in one grouped kernel]
Per-tensor scaling quantizes each expert's rows with one scale and its matrix with another
(fsdp8.fp8.grouped, [Note: FP8 experts]). The grouped kernel's row-wise mode multiplies each output
element by a scale of its row of ``a`` and one of its column of ``b``: giving every row of group g
its group's inverse scale, and every column of expert g the expert's, makes it compute exactly what
the per-group ``torch._scaled_mm`` with 0-d scales computes, for all groups in one launch and with
no group sizes read on the host. The three GEMMs of a step:

- out = x W^T: ``a`` the rows [T, K], ``b`` the experts [G, N, K] read column-major (their bytes as
  stored), offsets along T (the "2d-3d" form);
- dx = dy W: ``a`` the output gradient [T, N], ``b`` each expert's transpose [G, K, N] read
  column-major (made once per gather, cached on the gathered tensor), offsets along T;
- dW = dy^T x: the "2d-2d" form, contracted over each group's tokens. The kernel's FP8 operands are
  read 16 bytes at a time along the contraction, so every group's tokens start on a multiple of 16:
  each group is copied into a zero-padded buffer of ``round_up(T + 15 G, 16)`` token columns, a size
  known without reading the groups' sizes; zero columns add nothing. The last group takes the
  buffer's tail (zeros) as well. Per tensor, a group's transposed operand is its bytes transposed
  (the same scale reads them either way), so the quantization writes them there in the same pass
  (fsdp8/fp8/triton_grouped.py on the GPU; torch ops elsewhere).

All three use the kernel's fast accumulation (``BACKWARD_FAST_ACCUM`` says why).

The kernel takes ``float8_e4m3fn`` operands only and writes bf16: the forward runs in it for bf16
models; the backward too when the gradients are e4m3 (``fp8_format="e4m3"``). Under "hybrid"
(e5m2 gradients) the backward GEMMs go group by group through ``torch._scaled_mm``. The kernel is
probed once per device against its CPU emulation on a problem with uneven and empty groups; where
it disagrees or fails the group-by-group path runs (see ``kernel_runs``).
"""

from __future__ import annotations

import threading
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from . import triton_grouped
from .formats import E4M3, amax_to_scale, scale_to_inv
from .kernels import saturate_cast

ALIGN = 16  # tokens per group start in the weight-gradient buffer: 16 FP8 bytes
# torch 2.11's grouped FP8 kernel on an H200 (32768 x 2048 x 1536, 32 groups): 1050 TFLOP/s with
# fast accumulation, 351 without (bf16's grouped GEMM: 694), so every GEMM of the experts uses it,
# the backward's too (dense FP8 linears accumulate the backward precisely; the experts' GEMMs on
# this kernel would otherwise be slower than bf16). benchmarks/debug/grouped_fp8_gemms.py --kernels.
BACKWARD_FAST_ACCUM = True
_WORKS: Dict[str, bool] = {}
_LOCK = threading.Lock()


# -- the groups ------------------------------------------------------------------------------------
Bounds = List[Tuple[int, int]]


def bounds_of(ends: List[int]) -> Bounds:
    """(first row, end row) of each group whose end rows (cumulative) are ``ends``."""
    return list(zip([0] + ends[:-1], ends))


def group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows, on the device (empty groups own no row)."""
    return torch.searchsorted(offs, torch.arange(rows, dtype=offs.dtype, device=offs.device), right=True)


class Groups:
    """What the experts' GEMMs derive from the groups' cumulative row ends ``offs`` (int32 [G]),
    each at most once and shared by a layer's GEMMs and their backward (``expert_mlp`` makes one
    for both projections, whose rows are grouped alike):

    - ``bounds()``: the groups' (first, end) rows on the host: the one synchronisation, made only
      where a GEMM goes group by group (none where the caller knew them: ``known``);
    - ``row_group(rows)``: each row's group, on the device (torch ops: the CPU path);
    - ``padded(rows)``: the weight gradient's 16-aligned token buffer of the Note: each row's
      column, the groups' padded ends (the last taking the buffer's zero tail) and the width
      (torch ops: the CPU path and the reference);
    - ``sources(rows)``, ``padded_ends(rows)``: each column's row and the padded ends, what the
      GPU path reads (one Triton launch there)."""

    def __init__(self, offs: torch.Tensor, known: Optional[Bounds] = None):
        self.offs, self._bounds = offs, known
        self._derived: Dict[tuple, object] = {}

    def bounds(self) -> Bounds:
        if self._bounds is None:
            self._bounds = bounds_of(self.offs.tolist())
        return self._bounds

    def row_group(self, rows: int) -> torch.Tensor:
        key = ("group", rows)
        if key not in self._derived:
            self._derived[key] = group_of_rows(self.offs, rows)
        return self._derived[key]

    def counts(self) -> torch.Tensor:
        """Each group's rows (on ``offs``' device)."""
        if "counts" not in self._derived:
            self._derived["counts"] = torch.diff(self.offs, prepend=self.offs.new_zeros(1))
        return self._derived["counts"]

    def padded(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
        key = ("padded", rows)
        if key not in self._derived:
            counts = self.counts()
            padded_counts = (counts + ALIGN - 1) // ALIGN * ALIGN
            ends = torch.cumsum(padded_counts, 0).to(torch.int32)
            group = self.row_group(rows)
            # A row's column: its group's padded start plus its place in the group.
            column = ((ends - padded_counts).long() - (self.offs - counts).long())[group] + torch.arange(
                rows, device=self.offs.device)
            width = buffer_width(rows, self.offs.shape[0])
            self._derived[key] = (column, torch.cat([ends[:-1], ends.new_full((1,), width)]), width)
        return self._derived[key]

    def sources(self, rows: int) -> torch.Tensor:
        """The inverse of ``padded``'s columns: each column's row (int32 [width], -1 for padding),
        what the Triton cast reads to write the buffer column by column."""
        if not self._on_gpu():
            key = ("sources", rows)
            if key not in self._derived:
                column, _, width = self.padded(rows)
                source = torch.full((width,), -1, dtype=torch.int32, device=self.offs.device)
                self._derived[key] = source.scatter_(0, column, torch.arange(rows, dtype=torch.int32,
                                                                              device=self.offs.device))
            return self._derived[key]
        return self._gpu_columns(rows)[0]

    def padded_ends(self, rows: int) -> torch.Tensor:
        """``padded``'s group ends, what the weight gradient's GEMM takes as its offsets."""
        return self._gpu_columns(rows)[1] if self._on_gpu() else self.padded(rows)[1]

    def _on_gpu(self) -> bool:
        return self.offs.is_cuda and triton_grouped.available()

    def _gpu_columns(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        key = ("columns", rows)  # sources and padded ends in one launch, for a dozen small ops
        if key not in self._derived:
            self._derived[key] = triton_grouped.padded_columns(self.offs, buffer_width(rows, self.offs.shape[0]))
        return self._derived[key]


def buffer_width(tokens: int, groups: int) -> int:
    """Token columns of the weight gradient's buffer: room for every group padded to 16, a
    multiple of 16 (the kernel's rule for its dims), known without the groups' sizes."""
    return -(-(tokens + (ALIGN - 1) * groups) // ALIGN) * ALIGN


# -- quantization by group, on the device ----------------------------------------------------------
class GroupedBytes(NamedTuple):
    """Rows quantized with one scale per group."""

    data: Optional[torch.Tensor]  # [T, K], row-major
    inv: torch.Tensor  # [G] fp32: each group's inverse scale
    padded_t: Optional[torch.Tensor] = None  # [K, width]: the bytes in the weight gradient's token buffer
    row_inv: Optional[torch.Tensor] = None  # [T] fp32: each row's group's inverse scale (the GEMMs' row scales)


def group_amax(t: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """The largest magnitude of each group's rows of ``t`` [T, K] (fp32 [groups]; 0 for an empty
    group, NaN propagates), without a host synchronisation. The rows' maxima in one read
    (``vector_norm`` of order inf makes no |t| copy), then a max over each group's rows."""
    rows = torch.linalg.vector_norm(t.detach(), float("inf"), dim=1).float()
    return torch.zeros(groups, dtype=torch.float32, device=t.device).scatter_reduce_(0, group, rows, "amax")


def quantize_groups(t: torch.Tensor, fp8_dtype: torch.dtype, groups: Groups, padded: bool = False,
                    scale: Optional[torch.Tensor] = None) -> GroupedBytes:
    """Rows of ``t`` [T, K] quantized with one scale per group: ``scale`` [G] where given (delayed
    scaling's, from each group's history), else each group's own amax (current scaling);
    ``padded``: their bytes also in the weight gradient's 16-aligned token buffer (transposed;
    see the Note)."""
    tokens = t.shape[0]
    width = buffer_width(tokens, groups.offs.shape[0]) if padded else 0
    triton = triton_grouped.runs_on(t, width)
    if triton and scale is None:
        # The rows' maxima, then every scale (per group and per row) in one launch.
        rowmax = torch.linalg.vector_norm(t.detach(), float("inf"), dim=1)
        _, inv, row_scale, row_inv = triton_grouped.group_scales(rowmax, groups.offs, fp8_dtype)
    else:
        group = groups.row_group(tokens)
        if scale is None:
            scale = amax_to_scale(group_amax(t, group, groups.offs.shape[0]), fp8_dtype)
        inv = scale_to_inv(scale)
        row_scale, row_inv = scale[group], inv[group]
    if triton:  # the cast into both layouts, one launch
        data, padded_t = triton_grouped.group_cast(t.detach(), row_scale, fp8_dtype,
                                                   groups.sources(tokens) if padded else None, width)
    else:
        data = saturate_cast(t.detach(), row_scale[:, None], fp8_dtype)
        padded_t = _scatter_columns(data, *groups.padded(tokens)[::2]) if padded else None
    return GroupedBytes(data, inv, padded_t, row_inv)


def quantize_experts(w: torch.Tensor, fp8_dtype: torch.dtype,
                     scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each matrix of ``w`` [E, N, K] quantized with its own scale (``scale`` [E] where given, else
    its amax's): (bytes, inverse scales [E]). Its rows are E groups of N rows, so this is
    ``quantize_groups`` (the amax of a matrix is the largest of its rows' maxima)."""
    experts, n, k = w.shape
    offs = torch.arange(1, experts + 1, dtype=torch.int32, device=w.device) * n
    q = quantize_groups(w.detach().reshape(experts * n, k), fp8_dtype, Groups(offs), scale=scale)
    return q.data.view(experts, n, k), q.inv


# -- the kernel ------------------------------------------------------------------------------------
def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (row-wise scales, bf16 out) on CUDA; on other devices its
    emulation, which checks the same operand rules."""
    _check_operands(a, b, scale_a, scale_b, offs)
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast_accum)
    return _emulated(a, b, scale_a, scale_b, offs)


def _check_operands(a, b, scale_a, scale_b, offs) -> None:
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise ValueError(f"the grouped FP8 kernel takes float8_e4m3fn operands, got {a.dtype} and {b.dtype}")
    if a.stride(-1) != 1 or b.stride(-2) != 1:
        raise ValueError(f"the grouped FP8 kernel takes a row-major a and a column-major b, got strides "
                         f"{a.stride()} and {b.stride()}")
    if a.shape[-1] % 16 or b.shape[-1] % 16 or b.shape[-2] % 16:
        raise ValueError(f"the grouped FP8 kernel wants dims divisible by 16, got {tuple(a.shape)} x {tuple(b.shape)}")
    groups = offs.shape[0]
    if b.dim() == 3:  # 2d-3d
        want_a, want_b = (a.shape[0],), (groups, b.shape[2])
    else:  # 2d-2d
        want_a, want_b = (groups * a.shape[0],), (groups * b.shape[1],)
    if tuple(scale_a.shape) != want_a or tuple(scale_b.shape) != want_b or offs.dtype != torch.int32:
        raise ValueError(f"grouped FP8 kernel scales {tuple(scale_a.shape)}, {tuple(scale_b.shape)} (want {want_a}, "
                         f"{want_b}), offsets {offs.dtype} (want int32)")


def _emulated(a, b, scale_a, scale_b, offs) -> torch.Tensor:
    """The kernel's result from exactly dequantized operands and fp32 GEMMs, group by group. It
    also checks the rules the kernel asserts on the device (a failure there ends the process's
    CUDA context): the groups end within the rows, and in the 2d-2d form every group but the last
    starts its tokens on a multiple of 16."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    rows = a.shape[0] if b.dim() == 3 else a.shape[1]
    if any(e < s for s, e in zip(starts, ends)) or (ends and ends[-1] > rows):
        raise ValueError(f"grouped FP8 kernel offsets {ends} must rise and end within the {rows} rows")
    if b.dim() == 2 and any(e % ALIGN for e in ends[:-1]):
        raise ValueError(f"grouped FP8 kernel 2d-2d offsets {ends}: every group but the last must end on a multiple "
                         f"of {ALIGN} tokens (pad the groups, as weight_grad_gemm does)")
    af = a.float()
    if b.dim() == 3:
        out = torch.empty(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = (af[s:e] * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None, :])
        return out.to(torch.bfloat16)
    n, k = a.shape[0], b.shape[1]
    out = torch.empty(len(ends), n, k, dtype=torch.float32, device=a.device)
    bf = b.float()
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[g] = (af[:, s:e] * scale_a[g * n:(g + 1) * n, None]) @ (bf[s:e] * scale_b[g * k:(g + 1) * k][None, :])
    return out.to(torch.bfloat16)


# -- the three GEMMs -------------------------------------------------------------------------------
def forward_gemm(qx: GroupedBytes, w: torch.Tensor, inv_w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of group g of ``qx`` [T, K] times ``w[g]``.T (``w`` [G, N, K] bytes): [T, N] bf16."""
    count, n = w.shape[0], w.shape[1]
    return scaled_grouped_mm(qx.data, w.transpose(1, 2), qx.row_inv,
                             inv_w[:, None].expand(count, n).contiguous(), groups.offs, fast_accum=True)


def input_grad_gemm(qdy: GroupedBytes, w_t: torch.Tensor, inv_w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of group g of ``qdy`` [T, N] times ``w[g]`` [N, K], from ``w_t`` [G, K, N] (each
    expert's bytes transposed, contiguous): [T, K] bf16."""
    count, k = w_t.shape[0], w_t.shape[1]
    return scaled_grouped_mm(qdy.data, w_t.transpose(1, 2), qdy.row_inv,
                             inv_w[:, None].expand(count, k).contiguous(), groups.offs, fast_accum=BACKWARD_FAST_ACCUM)


def weight_grad_gemm(qdy: GroupedBytes, qx: GroupedBytes, groups: Groups, rows: int) -> torch.Tensor:
    """Group g's output-gradient rows transposed times its input rows: [G, N, K] bf16, from both
    operands' bytes in the 16-aligned token buffer of the Note (``padded_t``: [N, width] and
    [K, width], for ``rows`` rows)."""
    n, k = qdy.padded_t.shape[0], qx.padded_t.shape[0]
    ends = groups.padded_ends(rows)
    return scaled_grouped_mm(qdy.padded_t, qx.padded_t.t(), qdy.inv.repeat_interleave(n), qx.inv.repeat_interleave(k),
                             ends, fast_accum=BACKWARD_FAST_ACCUM)


def forward_in_kernel(x: torch.Tensor, w: torch.Tensor, inv_w: torch.Tensor, groups: Groups,
                      padded: bool, scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, GroupedBytes]:
    """The one-kernel forward (e4m3): ``x`` [T, K] quantized by group (``padded``: its bytes also in
    the weight gradient's buffer, made in the same pass; ``scale`` [G]: the groups' given scales,
    delayed scaling's) times the experts' bytes ``w`` [G, N, K]; (out [T, N] bf16, the quantized input)."""
    qx = quantize_groups(x, E4M3, groups, padded=padded, scale=scale)
    return forward_gemm(qx, w, inv_w, groups), qx


def backward_in_kernel(dy: torch.Tensor, w_t: Optional[torch.Tensor], inv_w: torch.Tensor, groups: Groups,
                       qx: Optional[GroupedBytes], input_grad: bool, weight_grad: bool,
                       scale: Optional[torch.Tensor] = None):
    """The one-kernel backward (e4m3 gradients): (dx or None, dW or None) from ``dy`` [T, N] (quantized
    with ``scale`` [G] where given), the experts' transposed bytes ``w_t`` [G, K, N] (for dx) and the
    forward's padded input ``qx`` (for dW)."""
    qdy = quantize_groups(dy, E4M3, groups, padded=weight_grad, scale=scale)
    dx = input_grad_gemm(qdy, w_t, inv_w, groups) if input_grad else None
    dw = weight_grad_gemm(qdy, qx, groups, dy.shape[0]) if weight_grad else None
    return dx, dw


def _scatter_columns(q: torch.Tensor, column: torch.Tensor, width: int) -> torch.Tensor:
    """``q`` [T, C] FP8 transposed into the zero buffer [C, width] at ``column`` (by bytes: an
    FP8 zero is the zero byte). Whole rows into the padded rows, then one transpose."""
    rows = q.view(torch.uint8).new_zeros(width, q.shape[1]).index_copy_(0, column, q.view(torch.uint8))
    return rows.t().contiguous().view(q.dtype)


# -- where the kernel runs -------------------------------------------------------------------------
def kernel_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` and agrees with its emulation
    (probed once per device on uneven and empty groups, all three GEMMs). False off CUDA:
    there the group-by-group path is faster than the emulation, which exists for the tests."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    works = _WORKS.get(str(device))  # no lock once known: a compiled graph traces this read
    if works is None:
        # Out of the trace (torch.compiler.disable imports dynamo, seconds: only when tracing).
        works = (torch.compiler.disable(_probe_once) if torch.compiler.is_compiling() else _probe_once)(device)
    return works


def _probe_once(device: torch.device) -> bool:
    key = str(device)
    with _LOCK:
        if key not in _WORKS:
            _WORKS[key] = _probe(device)
    return _WORKS[key]


def _probe(device: torch.device) -> bool:
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        operands = (torch.randn(40, 32, generator=g, dtype=torch.bfloat16),  # x
                    torch.randn(3, 48, 32, generator=g, dtype=torch.bfloat16),  # w
                    torch.randn(40, 48, generator=g, dtype=torch.bfloat16),  # dy
                    torch.tensor([7, 7, 40], dtype=torch.int32))  # uneven groups, one empty
        got = three_gemms(*(t.to(device) for t in operands))  # the kernel
        want = three_gemms(*operands)  # the emulation
        return max(_relative_error(a, b) for a, b in zip(got, want)) < 1e-2
    except Exception as err:  # noqa: BLE001 -- whatever breaks (a Triton compile too), the group path runs
        warnings.warn(f"fsdp8: torch._scaled_grouped_mm does not run here ({type(err).__name__}: {err}); FP8 "
                      f"experts multiply group by group", RuntimeWarning, stacklevel=2)
        return False


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius). The same FP8 operands both ways: the kernel's sums differ
    in order (and, in the forward, fast accumulation) only, far below 1e-2; a wrong layout or scale
    errs by order 1."""
    want = want.float()
    return float((got.float().cpu() - want).norm() / want.norm().clamp_min(1e-30))


def three_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor):
    """(out, dx, dW) of the Note for these high-precision operands, all quantized to e4m3 with
    per-tensor scales per group and per expert."""
    groups = Groups(offs)
    qx = quantize_groups(x, E4M3, groups, padded=True)
    qdy = quantize_groups(dy, E4M3, groups, padded=True)
    qw, inv_w = quantize_experts(w, E4M3)
    return (forward_gemm(qx, qw, inv_w, groups), input_grad_gemm(qdy, qw.transpose(1, 2).contiguous(), inv_w, groups),
            weight_grad_gemm(qdy, qx, groups, x.shape[0]))
