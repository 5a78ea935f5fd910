"""The planner's hardware: a small table of GPUs (and which of them this machine has), the cluster they
form, and the efficiencies it assumes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator as the planner sees it. Rates are dense peaks (no sparsity), links are
    per GPU and per direction (the datasheets' NVLink figures count both directions)."""

    name: str
    memory_gib: float  # what torch.cuda.get_device_properties(0).total_memory reports
    bf16_tflops: float
    fp8_tflops: float
    fp32_tflops: float  # without tensor cores: fp32 GEMMs run there unless TF32 is allowed
    hbm_gbps: float
    nvlink_gbps: float
    network_gbps: float  # the node's scale-out network, per GPU (one NIC each)
    pcie_gbps: float  # host link (CPU offload)
    host_gbps: float  # host memory bandwidth available to one GPU's optimizer step (CPU offload)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"GPU {self.name!r}: {f.name} must be a positive number, got {value!r}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


# Datasheet figures, dense (sparsity halved away):
# - H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet): BF16 989 TFLOP/s, FP8 1,979,
#   FP32 67, HBM3 3.35 TB/s, NVLink 900 GB/s (450 each way), PCIe Gen5 128 GB/s (64 each way).
# - H200 SXM 141GB (NVIDIA H200 Tensor Core GPU datasheet): the H100's compute and links,
#   HBM3e 4.8 TB/s.
# - B200 in HGX B200 (NVIDIA HGX B200 datasheet, per GPU): FP8 4.5 PFLOP/s, BF16 2.25,
#   FP32 75 TFLOP/s, 180 GB HBM3e at 7.7 TB/s, NVLink 5 1.8 TB/s (900 GB/s each way).
# Network: one 400 Gb/s NIC (ConnectX-7) per GPU, as in DGX/HGX H100, H200 and B200 nodes:
# 50 GB/s each way. Memory: what torch sees. H200: torch.cuda.get_device_properties on the
# lent H200 (150,109,880,320 bytes, 615 MiB under nvidia-smi's 143,771 MiB); H100: nvidia-smi's
# 81,559 MiB on the lent H100 less the same 615 MiB; B200: 179, what a provider's HGX B200
# documentation reports (not measured here). Host bandwidth: a two-socket node's ~320 GB/s of
# DRAM bandwidth shared by 8 GPUs (an assumption, used only with CPU offload).
GPUS = {
    "h100": GPU("h100", 79.1, 989.0, 1979.0, 67.0, 3350.0, 450.0, 50.0, 64.0, 40.0),
    "h200": GPU("h200", 139.8, 989.0, 1979.0, 67.0, 4800.0, 450.0, 50.0, 64.0, 40.0),
    "b200": GPU("b200", 179.0, 2250.0, 4500.0, 75.0, 7700.0, 900.0, 50.0, 64.0, 40.0),
}


def gpu_named(name: str, **overrides) -> GPU:
    """A GPU of the table, with any field replaced (``None`` values are ignored)."""
    key = name.strip().lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}, and override its figures with "
                         "--gpu-memory, --bf16-tflops, --fp8-tflops, --hbm-gbps, --nvlink-gbps, --network-gbps")
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(GPU)}
    if unknown:
        raise ValueError(f"unknown GPU figures {sorted(unknown)}")
    return dataclasses.replace(GPUS[key], **given)


def detect_gpu(name: Optional[str]) -> GPU:
    """The table's entry for this machine's GPU (or ``name``'s), with the memory torch sees here."""
    found = name
    if found is None:
        device = torch.cuda.get_device_name().lower()
        found = next((key for key in GPUS if key in device), None)
        if found is None:
            raise ValueError(f"the planner has no figures for {torch.cuda.get_device_name()!r}; pass --gpu "
                             f"({', '.join(GPUS)}) with the figures that differ (--bf16-tflops, --hbm-gbps, ...)")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return gpu_named(found, memory_gib=total / GIB)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs each, NVLink inside a node, the network between."""

    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu.name}"


@dataclass(frozen=True)
class HostCost:
    """Seconds this machine's host takes to issue one micro-batch's work, by pass: one layer's
    forward, its backward (recomputation included), the root's forward (embedding, final norm,
    head, loss) and its backward with the step's per-step work (clipping, the optimizer's
    launches) spread over the micro-batches. Measured by ``fsdp8 bench`` (fsdp8/app/bench/host.py);
    when given, it replaces the per-op host model of :class:`Efficiency`."""

    layer_fwd: float
    layer_bwd: float
    root_fwd: float
    root_bwd: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"HostCost.{f.name} must be seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class Efficiency:
    """The fractions of peak the planner assumes each kind of work reaches (docs/PLANNING.md).

    ``gemm``/``fp8_gemm``: dense GEMMs of transformer shapes; ``attention``: torch SDPA's
    flash/efficient kernels, forward and backward; ``hbm``: elementwise and copy kernels;
    ``link``: NCCL bus bandwidth against the per-direction peak (NVLink, network, PCIe alike).
    ``latency_us``: the fixed cost of one collective. ``host_sync_us``: one host synchronisation
    (expert parallelism's, one per MoE layer and forward: the all-to-all's split sizes read on
    the host, then the GPU idle until the host issues the next kernels; stated, not measured).
    The host, which launches eager kernels one by one: ``host_op_us`` per op, ``sac_op_us`` more
    per op of a forward pass under selective checkpointing (its policy runs in Python),
    ``fp8_linear_host_ms`` per FP8 linear's forward and backward. ``allocator``: the caching allocator's reserve above the peak of live
    tensors; ``runtime_gib``: memory outside torch's allocator (CUDA context, cuBLAS workspaces,
    NCCL buffers). The defaults are fitted to one H200 (docs/PLANNING.md). ``host``: the host's
    cost measured on this machine, which replaces the three host figures above."""

    gemm: float = 0.65
    fp8_gemm: float = 0.55
    attention: float = 0.30
    hbm: float = 0.70
    link: float = 0.80
    latency_us: float = 20.0
    host_sync_us: float = 50.0
    host_op_us: float = 10.0
    sac_op_us: float = 110.0
    fp8_linear_host_ms: float = 0.8
    allocator: float = 0.10
    runtime_gib: float = 1.0
    host: Optional[HostCost] = None

    def __post_init__(self):
        fractions = ("gemm", "fp8_gemm", "attention", "hbm", "link")
        if self.host is not None and not isinstance(self.host, HostCost):
            raise ValueError(f"Efficiency.host must be a HostCost or None, got {type(self.host).__name__}")
        for f in dataclasses.fields(self):
            if f.name == "host":
                continue
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or (f.name in fractions and not 0 < value <= 1):
                raise ValueError(f"Efficiency.{f.name}={value!r} is out of range")


# Kernels an eager forward of one Llama block launches (norms in fp32, rotary, the linears,
# attention, SwiGLU, residuals; counted in fsdp8.models.llama), of the root (embedding, final
# norm, head, loss), and the engine's per unit and pass (gather, copy-out, pack, reduce, land).
LAYER_OPS, ROOT_OPS, ENGINE_OPS = 48, 15, 10
# Kernels an MoE layer's forward adds (fsdp8.models.moe: router, top-k and its renormalisation, the
# load-balancing loss, the sort by expert, the gathered rows, two grouped GEMMs, SwiGLU, the
# weighted sum back), and expert parallelism's dispatch adds to those (parallel/ep.py: the counts'
# all-to-all, the split sizes, two all-to-alls, the regrouping and its inverse).
MOE_OPS, EP_OPS = 30, 12
# Kernels a compiled Llama block's forward launches (Inductor's fused kernels, the GEMMs and
# attention) and what a traced FP8 linear adds to them (its amax and scaled cast): docs/PERFORMANCE.md
# counted ~1,200 kernels in a compiled bf16 step of a 16-layer model and ~1,800 with FP8 linears,
# ~70 and ~105 a layer over forward and backward.
COMPILED_LAYER_OPS, TRACED_FP8_OPS = 24, 2


def host_model(eff: Efficiency, ac: str, fp8_linears: int, extra_ops: int = 0, units: int = 1,
               compiled: bool = False, traced_fp8: bool = False) -> HostCost:
    """The host's time per pass when nothing measured it: it issues every op of forward,
    backward (two passes' worth) and recomputation; an FP8 linear costs more (its forward's
    share again when recomputed), and selective checkpointing's policy runs in Python for every
    op of forward and of the recomputation. ``extra_ops``: kernels a layer issues beyond the
    Llama block's; ``units``: the engine's units a layer gathers and reduces. A ``compiled``
    layer launches Inductor's fused kernels instead, and FP8 linears ``traced_fp8`` into its
    graph (only where ``compiled``) cost their kernels only, not the eager linear's Python."""
    op = eff.host_op_us * 1e-6
    block_ops = COMPILED_LAYER_OPS + (TRACED_FP8_OPS * fp8_linears if traced_fp8 else 0) if compiled else LAYER_OPS
    fp8 = 0.0 if traced_fp8 else fp8_linears * eff.fp8_linear_host_ms * 1e-3
    recomputed = ac != "none"
    layer_ops, engine_ops = block_ops + extra_ops, units * ENGINE_OPS
    sac = layer_ops * eff.sac_op_us * 1e-6 if ac == "selective" else 0.0
    return HostCost(layer_fwd=(layer_ops + engine_ops) * op + fp8 / 3 + sac,
                    layer_bwd=((2 + recomputed) * layer_ops + engine_ops) * op + fp8 * (2 + recomputed) / 3 + sac,
                    root_fwd=(ROOT_OPS + ENGINE_OPS) * op, root_bwd=(2 * ROOT_OPS + ENGINE_OPS) * op)


def describe_gpu(gpu: GPU, base: Optional[GPU] = None) -> str:
    """One line naming the figures used (and which differ from the table's)."""
    changed = [] if base is None else [f.name for f in dataclasses.fields(GPU) if getattr(gpu, f.name) != getattr(base, f.name)]
    mark = f" (custom: {', '.join(changed)})" if changed else ""
    return (f"{gpu.name}{mark}: {gpu.memory_gib:g} GiB, bf16 {gpu.bf16_tflops:g} / fp8 {gpu.fp8_tflops:g} TFLOP/s, "
            f"HBM {gpu.hbm_gbps:g} GB/s, NVLink {gpu.nvlink_gbps:g} GB/s, network {gpu.network_gbps:g} GB/s")
