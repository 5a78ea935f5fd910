"""fsdp8.parallelize: a Hugging Face causal LM, unmodified, over tensor and data parallelism.

Run on CPUs:  torchrun --nproc_per_node 2 examples/parallelize.py      (tp 2)
Run on GPUs:  torchrun --nproc_per_node 8 examples/parallelize.py      (dp 4 x tp 2)
"""

import sys

import torch

try:
    import transformers
except ImportError as e:  # a line saying what to install, not a traceback
    sys.exit(f'examples/parallelize.py needs transformers ({e}): pip install -e ".[hf]"')

import fsdp8

fsdp8.init_distributed()
rank = torch.distributed.get_rank()
config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)  # the same seed on every rank: each keeps its part of the same model
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)  # nothing allocated until parallelize
model = fsdp8.parallelize(model, fsdp8.ParallelConfig(
    tp=2, sequence_parallel=True,       # the TP plan comes from the model's own base_model_tp_plan
    activation_checkpointing="full",    # "none" | "full" | "selective"
))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = fsdp8.data.ByteCorpus()
for step in range(10):
    x, _ = data.batch(step, 0, 1, batch_per_rank=4 * model.dp_size, seq_len=32)  # the global batch
    batch = model.shard_batch({"input_ids": x, "labels": x})  # this data-parallel rank's rows, on its device
    loss = model(**batch).loss
    loss.backward()
    fsdp8.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    if rank == 0 and step % 3 == 0:
        print(f"step {step} loss {loss.item():.3f}")
if rank == 0:
    print(f"layout {model.device_mesh}, data-parallel rank {model.dp_rank} of {model.dp_size}")
    print(model.memory_report())
