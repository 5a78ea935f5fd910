"""Mixture-of-experts weights stored one expert at a time, read into a model that holds them as
3-D tensors.

transformers 5 keeps a layer's experts as ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I], while the checkpoints on the Hub (and what its own
``save_pretrained`` writes, for older readers) store ``experts.{e}.gate_proj.weight`` [I, H],
``experts.{e}.up_proj.weight`` and ``experts.{e}.down_proj.weight`` [H, I] (Qwen-MoE and most
families), or Mixtral's ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``. transformers merges
them when it loads (its conversion mapping: the per-expert matrices stacked, gate and up
concatenated); ``load_pretrained`` does the same here, reading for each rank only the
experts, rows and columns of its piece (its ep share, then its engine rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

# (the model's 3-D tensor, the per-expert tensors concatenated along their rows, in order)
# for each layout a family's checkpoints use, and the module paths they sit under.
_LAYOUTS = (
    {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
    {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
)
# Module paths transformers 5 renamed: (the model's, the files'); Mixtral's router and experts.
_RENAMED_BLOCKS = ((".mlp.", ".block_sparse_moe."),)


@dataclass(frozen=True)
class FusedExperts:
    """A 3-D experts tensor as its per-expert pieces in the files: ``parts[e]`` are expert
    ``e``'s file names, whose rows are concatenated in that order."""

    parts: Tuple[Tuple[str, ...], ...]

    def shape(self, files) -> Tuple[int, ...]:
        shapes = [files.file_of(name).shape(name) for name in self.parts[0]]
        return (len(self.parts), sum(s[0] for s in shapes), shapes[0][1])

    def read(self, files, region: Optional[Sequence[Tuple[int, int]]] = None) -> torch.Tensor:
        """The experts, rows and columns of ``region`` (all of them without one)."""
        experts, rows, cols = region or [(0, n) for n in self.shape(files)]
        return torch.stack([self._read_expert(files, e, rows, cols) for e in range(*experts)])

    def _read_expert(self, files, expert: int, rows: Tuple[int, int], cols: Tuple[int, int]) -> torch.Tensor:
        pieces, offset = [], 0
        for name in self.parts[expert]:
            height = files.file_of(name).shape(name)[0]
            start, stop = max(rows[0] - offset, 0), min(rows[1] - offset, height)
            if start < stop:
                pieces.append(files.file_of(name).read(name, [(start, stop), cols]))
            offset += height
        return torch.cat(pieces)


def find_fused(names: Sequence[str], files) -> Optional[FusedExperts]:
    """The per-expert pieces in ``files`` of the experts tensor a model knows by ``names``
    (e.g. ``model.layers.0.mlp.experts.gate_up_proj``), or None."""
    for name in names:
        prefix, _, tensor = name.rpartition(".")
        for layout in _LAYOUTS:
            if tensor not in layout:
                continue
            for path in _stored_paths(prefix):
                parts = _per_expert(path, layout[tensor], files)
                if parts:
                    return FusedExperts(parts)
    return None


def model_path(file_name: str) -> str:
    """A file's tensor name under the module path the model has now (Mixtral's
    ``block_sparse_moe`` is ``mlp`` since transformers 5)."""
    for model, stored in _RENAMED_BLOCKS:
        file_name = file_name.replace(stored, model)
    return file_name


def _stored_paths(prefix: str) -> List[str]:
    paths = [prefix]
    for model, stored in _RENAMED_BLOCKS:
        if model in prefix + ".":
            paths.append((prefix + ".").replace(model, stored)[:-1])
    return paths


def _per_expert(path: str, pieces: Tuple[str, ...], files) -> Tuple[Tuple[str, ...], ...]:
    """Expert 0, 1, ... as long as each has all its pieces at ``path.{e}.{piece}.weight``."""
    parts = []
    while True:
        names = tuple(f"{path}.{len(parts)}.{piece}.weight" for piece in pieces)
        if not all(n in files for n in names):
            return tuple(parts)
        parts.append(names)
