"""fsdp8 in one page: shard a model, train it with a stock optimizer, save its state.

Run on CPUs:  torchrun --nproc_per_node 2 examples/quickstart.py
Run on GPUs:  torchrun --nproc_per_node <gpus> examples/quickstart.py
"""

import torch

import fsdp8
from fsdp8.models.llama import Llama, preset

fsdp8.init_distributed()  # NCCL on GPUs, gloo on CPUs; a single process without torchrun
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)  # same seed on every rank: meta-device init draws the same values everywhere
with torch.device("meta"):
    model = Llama(preset("tiny"))  # no memory used until fully_shard materializes shards
model = fsdp8.fully_shard(
    model,
    strategy="optim_grads_params",  # ZeRO-3; or "no_shard", "optim", "optim_grads", 0..3
    precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # parameters are sharded fp32 DTensors

data = fsdp8.data.ByteCorpus()
for step in range(20):
    x, y = data.batch(step, rank, world, batch_per_rank=4, seq_len=64)
    with model.no_sync():  # accumulate gradients; ZeRO-3 still reduce-scatters (its gradients are sharded)
        model(x[:2].to(device), y[:2].to(device)).div(2).backward()
    loss = model(x[2:].to(device), y[2:].to(device)).div(2)
    loss.backward()
    fsdp8.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()

state = model.state_dict()  # original names, DTensor values: torch.distributed.checkpoint can save it
if rank == 0:
    print(f"loss {2 * loss.item():.3f}; {len(state)} tensors, e.g. {next(iter(state))}")
    print(model.memory_report())
torch.distributed.destroy_process_group()
