"""Hugging Face models under fully_shard, run on every rank by tests/dist/test_hf.py."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp8

from . import common

VOCAB = 256


def hf_model(kind: str, seed: int = 0, meta: bool = False) -> nn.Module:
    """A tiny transformers causal LM (no dropout), built on CPU or on the meta device."""
    import transformers as tf

    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
    cls, config = {
        "gpt2": (tf.GPT2LMHeadModel, lambda: tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**small)),
        "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**small)),
        "gpt_neox": (tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(
            hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=VOCAB,
            max_position_embeddings=64)),
    }[kind]
    torch.manual_seed(seed)
    if not meta:
        return cls(config())
    with torch.device("meta"):
        return cls(config())


class CausalLM(nn.Module):
    """(tokens, targets) -> loss around an HF model: the interface tests.dist.common trains."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    @property
    def embed(self) -> nn.Embedding:  # common.vocab_of reads the vocabulary from it
        return self.hf.get_input_embeddings()

    def forward(self, tokens, targets):
        logits = self.hf(input_ids=tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu()


def _bf16_compute(fp8=None):
    return dict(precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), fp8=fp8)


def gpt2_fp8_parity(steps: int = 4):
    """GPT-2 (Conv1D projections) under fully_shard with current scaling, against the same
    recipe in one process (convert_to_fp8 on the plain blocks), step by step from equal
    weights as tests/dist/test_fp8_engine.py does; and the first loss next to a bf16 run's."""
    recipe = fsdp8.Float8CurrentScaling()
    model = CausalLM(hf_model("gpt2")).to(common.device())
    bf16 = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    for block in reference.hf.transformer.h:
        fsdp8.convert_to_fp8(block, recipe)
    sharded = fsdp8.fully_shard(model, **_bf16_compute(recipe))
    bf16 = fsdp8.fully_shard(bf16, **_bf16_compute())
    converted = sorted(n for n, m in sharded.named_modules() if type(m).__name__ == "Float8Conv1D")
    x, y = (t.to(common.device()) for t in common.global_batch(0, 4, 8, VOCAB))
    with torch.no_grad():
        losses = float(sharded(x, y)), float(bf16(x, y))
    errors = common.lockstep_errors(sharded, reference, steps, torch.bfloat16)
    return errors, converted, losses


def meta_init(kind: str):
    """A transformers model built on meta and sharded: what is left on meta, how its values
    compare with the same model built on CPU (constants exactly, random tensors by their
    standard deviation: the model's own init scheme, drawn in another order), its rotary
    tables, and its forward against the CPU model holding the sharded model's weights."""
    from fsdp8.engine.materialize import meta_leftovers

    sharded = fsdp8.fully_shard(hf_model(kind, meta=True))
    cpu = hf_model(kind)
    state = {k: _full(v) for k, v in sharded.state_dict().items()}
    constants, stds = {}, {}
    for name, ref in cpu.state_dict().items():
        if ref.numel() > 1 and float(ref.std()) > 0:
            stds[name] = float(state[name].std() / ref.std())
        else:
            constants[name] = torch.equal(state[name], ref)
    cpu_buffers = dict(cpu.named_buffers())
    rotary = {n: torch.equal(b.cpu(), cpu_buffers[n]) for n, b in sharded.named_buffers() if "inv_freq" in n}
    cpu.load_state_dict(state)
    tokens = common.global_batch(0, 2, 16, VOCAB)[0]
    with torch.no_grad():
        logits_err = float((sharded(input_ids=tokens.to(common.device())).logits.cpu()
                            - cpu(input_ids=tokens).logits).abs().max())
    return dict(leftovers=meta_leftovers(sharded), constants=constants, stds=stds, rotary=rotary,
                logits_err=logits_err, state=state if common.rank() == 0 else None)


def load_pretrained_sharded(kind: str, path: str, fp8: bool):
    """A meta-built sharded model (FP8 or not) filled by load_pretrained from an HF
    save_pretrained directory of ``hf_model(kind)``: the largest difference from that model's
    weights (converted Conv1D weights compared transposed), its forward against the HF model's
    (without FP8), and which tensors a rank read whole rather than as its block."""
    from fsdp8.checkpoint import safetensors as st

    sharded = fsdp8.fully_shard(hf_model(kind, seed=1, meta=True), fp8=fsdp8.Float8CurrentScaling() if fp8 else None)
    whole = []
    original = st.SafetensorsFile.read

    def counting(self, name, region=None):
        if region is None:
            whole.append(name)
        return original(self, name, region)

    st.SafetensorsFile.read = counting
    try:
        fsdp8.load_pretrained(sharded, path)
    finally:
        st.SafetensorsFile.read = original
    saved = hf_model(kind)
    transposed = {f"{n}.weight" for n, m in sharded.named_modules() if type(m).__name__ == "Float8Conv1D"}
    state_err, files = 0.0, saved.state_dict()
    for name, value in sharded.state_dict().items():
        want = files[name].t() if name in transposed else files[name]
        state_err = max(state_err, float((_full(value) - want).abs().max()))
    logits_err = None
    if not fp8:
        tokens = common.global_batch(0, 2, 16, VOCAB)[0]
        with torch.no_grad():
            logits_err = float((sharded(input_ids=tokens.to(common.device())).logits.cpu()
                                - saved(input_ids=tokens).logits).abs().max())
    return state_err, logits_err, sorted(whole), sorted(transposed)


def fp8_gpt2_checkpoint_roundtrip(hf_path: str, ckpt: str, exported: str):
    """An FP8 GPT-2 filled from HF files, saved with fsdp8.save, loaded into a fresh one with
    fsdp8.load, exported and read back by load_pretrained (the (out, in) layout as it is):
    the largest difference of each copy from the first model."""
    from fsdp8.checkpoint import export

    def fresh(seed):
        return fsdp8.fully_shard(hf_model("gpt2", seed=seed, meta=True), fp8=fsdp8.Float8CurrentScaling())

    first = fresh(1)
    fsdp8.load_pretrained(first, hf_path)
    fsdp8.save(ckpt, first)
    loaded = fresh(2)
    fsdp8.load(ckpt, loaded)
    if common.rank() == 0:
        export(ckpt, exported)
    torch.distributed.barrier()
    reread = fresh(3)
    fsdp8.load_pretrained(reread, exported)
    want = {k: _full(v) for k, v in first.state_dict().items()}
    converted = sum(type(m).__name__ == "Float8Conv1D" for m in first.modules())
    return converted, [max(float((_full(v) - want[k]).abs().max()) for k, v in m.state_dict().items())
                       for m in (loaded, reread)]


def load_pretrained_tensor_parallel(path: str):
    """load_pretrained into a dp2 x tp2 model (torch ParallelStyles placed the weights, as in
    tests/dist/tp_engine_workers.py): the largest difference from the weights in the file."""
    from fsdp8.checkpoint import safetensors

    from . import tp_engine_workers as tp

    mesh = tp.world_mesh(1, 2, 2)
    source = tp.build(vocab=9, seed=0)
    if common.rank() == 0:
        safetensors.write(path, {k: v.detach() for k, v in source.state_dict().items()})
    torch.distributed.barrier()
    model = tp.build(vocab=9, seed=1)
    tp.place(model, mesh["tp"])
    sharded = fsdp8.fully_shard(model, mesh=mesh["dp_shard"])
    read = []
    original = safetensors.SafetensorsFile.read

    def counting(self, name, region=None):
        value = original(self, name, region)
        read.append(value.numel())
        return value

    safetensors.SafetensorsFile.read = counting
    try:
        fsdp8.load_pretrained(sharded, path)
    finally:
        safetensors.SafetensorsFile.read = original
    # What this rank keeps: its dp rows of its tp piece (the layout's shape is the piece's).
    needed = 0
    for unit in sharded._fsdp8.all_units:
        for slot in unit.slots:
            start, stop = slot.layout.chunk_row_range(unit.chunk_index)
            needed += (stop - start) * slot.layout.row_numel
    got = tp.full_state(sharded)
    error = max(float((got[k].cpu() - v.cpu()).abs().max()) for k, v in source.state_dict().items())
    return error, sum(read), needed, sum(v.numel() for v in source.state_dict().values())
