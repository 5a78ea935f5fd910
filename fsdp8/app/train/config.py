"""What a ``fsdp8 train`` run is: its settings (``TrainConfig``, checked as they are made),
its model on the meta device, and what the launching process checks before any worker
starts (layout against the world size, data file, model directory, tensor-parallel shapes,
vocabulary)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, List, Mapping

import torch

from ...checkpoint.safetensors import SafetensorsError
from ...checkpoint.transfer import check_pretrained
from ...checkpoint.verify import inspect
from ...config import ParallelConfig
from ...data import (VOCAB_SIZE, check_text_file, check_token_count, encode_data, has_tokenizer,
                     load_tokenizer, read_data)
from ...engine.state_dict import StateDictError, describe_mismatch
from ...models.adapter import adapter_for
from ...models.hf_dir import config_file, import_transformers, read_config
from ...models.llama import Llama, preset
from ...parallel.cp import local_multiple
from ...parallel.ep import check_expert_parallel
from ...parallel.tp import check_shapes, resolve_plan
from ..args import LAYOUT_DEFAULTS, flags_of, parallel_from_flags

HF_PREFIX = "hf:"
# A --data file up to this size is tokenized in the launching process to check its length
# (well under a second); a longer one is checked by the workers, which tokenize it anyway.
TOKENIZED_HERE_BYTES = 8 << 20


@dataclass(frozen=True)
class TrainConfig:
    """A run's settings. The command line makes one with ``from_settings`` (the flags by argparse
    name) and a checkpoint keeps ``settings()``; ``parallel`` is what parallelize is given, as the
    layout flags make it (``precision=None``: --precision auto, resolved where the workers run)."""

    steps: int = 200
    preset: str = "tiny"  # the built-in Llama's size
    model: str = ""  # "hf:DIR": a Hugging Face model directory instead of the built-in Llama ("": none)
    data: str = ""  # a text file to train on ("": the packaged corpus)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch_size: int = 8  # sequences per data-parallel rank per optimizer step
    seq_len: int = 128
    micro_batches: int = 1
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    out: str = "runs/train"
    save_every: int = 0  # steps between checkpoints (0: none), under <out>/checkpoints
    keep_last: int = 2
    resume: str = ""  # a checkpoint, or a run or checkpoints directory to take the latest from ("": start afresh)
    overwrite: bool = False  # start afresh where an earlier run's outputs are (fsdp8 train deletes them first)
    stop_at: int = 0  # stop after this step (as if interrupted) with a checkpoint; 0: run to --steps
    async_save: bool = False
    lr_decay_steps: int = 0  # the cosine schedule's length (0: steps); a resumed run keeps its checkpoint's
    tensorboard: str = ""  # a directory for TensorBoard event files of the metrics ("": none)

    def __post_init__(self):
        if self.model and (not self.model.startswith(HF_PREFIX) or self.model == HF_PREFIX):
            raise ValueError(f"--model takes hf:DIR (a Hugging Face model directory), got {self.model!r}")
        for name in ("steps", "batch_size", "seq_len", "micro_batches", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --micro-batches {self.micro_batches}")
        if self.save_every < 0 or self.stop_at < 0 or self.keep_last < 1:
            raise ValueError("--save-every and --stop-at must be >= 0 and --keep-last >= 1")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        max_seq_len = preset(self.preset).max_seq_len
        if not self.model and self.seq_len > max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the {self.preset!r} preset's {max_seq_len} positions; "
                             f"pass --seq-len {max_seq_len} or less, or a larger --preset")
        self._check_sequence_split()
        if self.resume and self.overwrite:
            raise ValueError("--resume continues a run and --overwrite deletes it: pass one of them")
        if self.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401  (checked here: before any worker starts)
            except ImportError as e:
                raise ValueError(f"--tensorboard needs the tensorboard package ({e}): "
                                 "pip install tensorboard") from None

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "TrainConfig":
        """The TrainConfig of ``settings`` named as fsdp8 train's flags (parsed, or a checkpoint's
        saved ``settings()``): the layout flags make ``parallel``, the others are fields."""
        return cls(parallel=parallel_from_flags(settings),
                   **{name: value for name, value in settings.items() if name not in LAYOUT_DEFAULTS})

    def settings(self) -> dict:
        """Every setting by fsdp8 train's flag names, the layout's in its flags' words: what a
        checkpoint saves for a resume to take back (``from_settings``), and summary.json shows."""
        values = {}
        for f in fields(self):
            values.update(flags_of(self.parallel) if f.name == "parallel" else {f.name: getattr(self, f.name)})
        return values

    def _check_sequence_split(self) -> None:
        """--seq-len against the layout's cuts of a sequence (the world size is ``check_run``'s)."""
        p = self.parallel
        split_tp = p.tp if p.sequence_parallel else 1
        if p.cp > 1:
            multiple = p.cp * local_multiple(p.cp, split_tp)
            why = f"--cp {p.cp} cuts each sequence into 2 x {p.cp} equal chunks"
            if split_tp > 1:
                why += f" and --sequence-parallel splits each rank's part over --tp {p.tp}"
        else:
            multiple, why = split_tp, f"--sequence-parallel splits each sequence over --tp {p.tp}"
        if self.seq_len % multiple:
            raise ValueError(f"--seq-len {self.seq_len} is not a multiple of {multiple}: {why}; pass --seq-len "
                             f"{max(multiple, self.seq_len - self.seq_len % multiple)}")

    @property
    def hf_dir(self) -> str:
        """The Hugging Face model directory of ``--model hf:DIR`` ("" for the built-in Llama)."""
        return self.model[len(HF_PREFIX):] if self.model else ""

    @property
    def model_name(self) -> str:
        return self.model or f"preset {self.preset}"


def _hf_config(directory: str):
    return import_transformers("--model hf:DIR").AutoConfig.from_pretrained(directory)


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """The run's model on the meta device: nothing is allocated until parallelize
    materializes each rank's shards (seed the RNG first: every rank draws the same values)."""
    if not cfg.model:
        with torch.device("meta"):
            return Llama(preset(cfg.preset))
    config = _hf_config(cfg.hf_dir)
    with torch.device("meta"):
        # fp32 whatever config.json's dtype: these are the main weights; --precision sets the compute dtype.
        return import_transformers("--model hf:DIR").AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def weight_files(directory: str) -> List[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))


def check_run(cfg: TrainConfig, world: int) -> None:
    """What the launching process checks before any worker starts, beyond the flags
    themselves: the layout against the ``world`` size, the data file, the model directory, the
    tensor-parallel shapes, and the data's vocabulary against the model's. Raises ValueError
    saying what to change."""
    p = cfg.parallel
    degree = p.dp_replicate * p.cp * p.tp
    if world % degree:
        raise ValueError(f"{world} worker processes do not divide into groups of --dp-replicate {p.dp_replicate} x "
                         f"--cp {p.cp} x --tp {p.tp} = {degree}; run a multiple of {degree} workers (--nproc), or "
                         "change those degrees")
    if cfg.data:
        check_text_file(cfg.data)
    vocab = preset(cfg.preset).vocab_size
    if cfg.model:
        vocab = _check_hf_dir(cfg).vocab_size
    if p.tp > 1:
        _check_tensor_parallel(cfg)
    if p.ep > 1:
        _check_expert_parallel(cfg, world // degree)
    if p.load_balancing == "global":
        try:  # what parallelize asks in every worker, here in one line before they start
            adapter_for(model := build_model(cfg)).load_balancing_modules(model)
        except ValueError as e:
            raise ValueError(f"--load-balancing global: {e}") from None
    if cfg.model and weight_files(cfg.hf_dir) and not cfg.resume:
        _check_weights(cfg)
    if cfg.resume:
        _check_checkpoint_shapes(cfg)
    data = f"--data {cfg.data}" if cfg.data else "the packaged corpus"
    if cfg.model and has_tokenizer(cfg.hf_dir):
        tokenizer = load_tokenizer(cfg.hf_dir)
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer in {cfg.hf_dir} has {len(tokenizer)} tokens, more than the model's "
                             f"vocabulary of {vocab} (config.json vocab_size); give the directory a config and "
                             "tokenizer that agree")
        # Only a short file can be too short; the workers check a longer one once they have its tokens.
        if not cfg.data or os.path.getsize(cfg.data) <= TOKENIZED_HERE_BYTES:
            check_token_count(len(encode_data(read_data(cfg.data or None), tokenizer)), cfg.seq_len,
                              f"{data} (read with the tokenizer of {cfg.hf_dir})")
        return
    if vocab < VOCAB_SIZE:
        raise ValueError(f"{data} is read as bytes ({VOCAB_SIZE} token ids), but {cfg.model_name} has a vocabulary "
                         f"of {vocab}; use a model with vocab_size >= {VOCAB_SIZE}, or put a tokenizer in its "
                         "directory")
    if cfg.data:
        check_token_count(os.path.getsize(cfg.data), cfg.seq_len, f"{data} (read as bytes)")


def _check_checkpoint_shapes(cfg: TrainConfig) -> None:
    """The model tensors of the checkpoint to resume against the model's shapes (what ``load``
    checks on every rank, here in one line)."""
    metadata = inspect(cfg.resume)[1]
    if metadata is None:  # unreadable: run_dir refused it already, unless it broke since
        return
    saved = {name[len("model."):]: tuple(meta.size) for name, meta in metadata.state_dict_metadata.items()
             if name.startswith("model.") and hasattr(meta, "size")}
    mis_shaped = [f"{name}: checkpoint {saved[name]} vs model {tuple(t.shape)}"
                  for name, t in build_model(cfg).state_dict().items() if saved.get(name, tuple(t.shape)) != t.shape]
    if mis_shaped:
        raise ValueError(f"--resume: {cfg.resume} does not fit {cfg.model_name}: "
                         f"{describe_mismatch([], [], mis_shaped)}; resume it with the model it was saved with")


def _check_weights(cfg: TrainConfig) -> None:
    """The weight files of ``--model hf:DIR`` against the model its config.json makes: readable
    headers, sizes that hold the data they list, every weight there in its shape."""
    try:
        check_pretrained(build_model(cfg), cfg.hf_dir)
    except (SafetensorsError, StateDictError) as e:
        raise ValueError(f"--model {cfg.model}: {e}") from None


def _check_hf_dir(cfg: TrainConfig):
    """The text config of ``--model hf:DIR``, after checking the directory and the sequence length."""
    directory = cfg.hf_dir
    if not os.path.isfile(os.path.join(directory, "config.json")):
        what = "has no config.json" if os.path.isdir(directory) else "is not a directory"
        raise ValueError(f"--model {cfg.model}: {directory} {what}; give a Hugging Face model directory (config.json, "
                         "optionally *.safetensors weights and a tokenizer)")
    try:
        import_transformers(f"--model {cfg.model}")
    except ImportError as e:
        raise ValueError(str(e)) from None
    read_config(directory)  # JSON mistakes said precisely, before transformers words them its way
    try:
        config = _hf_config(directory)
    except Exception as e:  # whatever transformers raises there (its field checks derive from Exception only)
        raise ValueError(f"--model {cfg.model}: transformers cannot read {config_file(directory)}: "
                         f"{' '.join(str(e).split())}") from None
    if not weight_files(directory) and any(name.endswith((".bin", ".pt", ".pth")) for name in os.listdir(directory)):
        raise ValueError(f"--model {cfg.model}: the weights in {directory} are not safetensors files, which is what "
                         "fsdp8 reads; save them with save_pretrained(..., safe_serialization=True), or remove them "
                         "to start from a fresh init")
    text_config = config.get_text_config()
    positions = getattr(text_config, "max_position_embeddings", None)
    if positions and cfg.seq_len > positions:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the {positions} positions of {cfg.model} "
                         f"(max_position_embeddings); pass --seq-len {positions} or less")
    return text_config


def _check_expert_parallel(cfg: TrainConfig, dp_shard: int) -> None:
    """--ep against the data-parallel shard ranks and the model's experts, on a meta-device copy
    (what parallelize checks in every worker, here in one line before they start)."""
    ep = cfg.parallel.ep
    if dp_shard % ep:
        raise ValueError(f"--ep {ep} must divide the {dp_shard} data-parallel shard ranks (--nproc / (--dp-replicate x "
                         "--cp x --tp)), from which expert parallelism borrows its ranks; change --ep or --nproc")
    try:
        check_expert_parallel(build_model(cfg), ep, cfg.parallel.tp)
    except ValueError as e:
        hint = "; a built-in mixture-of-experts model is --preset moe-tiny" if not cfg.model else ""
        raise ValueError(f"--ep {ep}: {e}{hint}") from None


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """The model's tensor-parallel plan against --tp, on a meta-device copy (what parallelize checks
    in every worker, here in one line before they start)."""
    model, p = build_model(cfg), cfg.parallel
    if p.ep == 1 and adapter_for(model).experts(model):
        raise ValueError(f"--tp {p.tp} with a mixture-of-experts model: tensor parallelism splits attention and dense "
                         "layers, and the experts go to expert parallelism; add --ep N (N > 1 dividing the "
                         "data-parallel shard ranks), or use --tp 1")
    try:
        family = adapter_for(model).tp_plan(model, p.sequence_parallel, p.loss_parallel)
        if family is None:
            raise ValueError(f"{type(model).__name__} has no automatic tensor-parallel plan (its config has no "
                             "base_model_tp_plan); use --tp 1")
        modules = dict(model.named_modules())
        check_shapes(modules, resolve_plan([name for name in modules if name], family.styles, None), p.tp, family)
    except ValueError as e:
        raise ValueError(f"--tp {p.tp}: {e}") from None
