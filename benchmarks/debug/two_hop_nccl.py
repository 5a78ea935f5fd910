"""Debug: the two-hop all-gather of ZeRO-3 + outer "optim" HSDP over NCCL, by hand.

    torchrun --nproc_per_node 4 benchmarks/debug/two_hop_nccl.py

Each rank (r, s) of a (2, 2) mesh owns chunk k = r * S + s filled with k. Hop 1 gathers the
R chunks of a shard position across replicas (in place into a cache), hop 2 gathers the S
caches inside the shard group; the result, read as [S, R, M] transposed, must be chunks
0..N-1 in order. Variants: in place or not, on a side stream or the default stream.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
R, S, M = 2, 2, 1 << 20
r, s = mesh.get_local_rank(0), mesh.get_local_rank(1)
rep, shard = mesh.get_group(0), mesh.get_group(1)
k = r * S + s
side = torch.cuda.Stream(priority=-1)
expected = torch.arange(R * S, device="cuda", dtype=torch.float32).repeat_interleave(M)
for in_place in (True, False):
    for use_side in (False, True):
        for trial in range(3):
            cache = torch.empty(R * M, device="cuda")
            stream = side if use_side else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                main = torch.full((M,), float(k), device="cuda")
                if in_place:
                    own = cache[r * M:(r + 1) * M]
                    own.copy_(main)
                    dist.all_gather_into_tensor(cache, own, group=rep)
                else:
                    dist.all_gather_into_tensor(cache, main, group=rep)
                gathered = torch.empty(R * S * M, device="cuda")
                dist.all_gather_into_tensor(gathered, cache, group=shard)
                out = gathered.view(S, R, M).transpose(0, 1).reshape(-1)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            ok = torch.equal(out, expected)
            cache_vals = cache.view(R, M)[:, 0].tolist()
            if rank == 0 or not ok:
                print(f"rank {rank} (r={r}, s={s}) in_place={in_place} side={use_side} trial={trial}: "
                      f"{'ok' if ok else 'WRONG'} cache={cache_vals} out={out.view(R * S, M)[:, 0].tolist()}", flush=True)
if rank == 0:
    # The engine's copy-out reads the gathered [S, R, M] through a transposed view.
    # torch 2.11 (H200): a transposed source into contiguous outputs came out wrong, a
    # transposed source into transposed outputs right; the engine now copies region by region.
    base = torch.randn(3, 2, 1000, device="cuda")
    sizes = [400, 600]
    cases = {
        "transposed source, contiguous outs": (base.transpose(0, 1), lambda n: torch.empty(2, 3, n, device="cuda")),
        "transposed source, transposed outs": (base.transpose(0, 1),
                                               lambda n: torch.empty(3, 2, n, device="cuda").transpose(0, 1)),
        "contiguous source, transposed outs": (base, lambda n: torch.empty(2, 3, n, device="cuda").transpose(0, 1)),
    }
    for name, (source, make) in cases.items():
        outs = [make(n) for n in sizes]
        torch.split_with_sizes_copy(source, sizes, dim=2, out=outs)
        want = [source[..., :400], source[..., 400:]]
        print("split_with_sizes_copy,", name, ":", [bool(torch.equal(o, w)) for o, w in zip(outs, want)], flush=True)
print(f"rank {rank}: rep group ranks {dist.get_process_group_ranks(rep)} shard group ranks "
      f"{dist.get_process_group_ranks(shard)} my rank in rep {dist.get_rank(rep)} shard {dist.get_rank(shard)}", flush=True)
dist.destroy_process_group()
