"""The SwiGLU MLPs fsdp8 can run as one FP8 function (mlp.py): which child of such an MLP is its
gate, up and down projection. A model registers its own MLP class here (the built-in Llama's
FeedForward does, models/llama.py); Hugging Face's ``LlamaMLP`` form (``down_proj(act_fn(
gate_proj(x)) * up_proj(x))`` with SiLU: Llama, Mistral, Qwen2/3 and the other models whose MLP
is a copy of it) is recognised by its forward."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn as nn

_REGISTERED: Dict[type, Tuple[str, str, str]] = {}


def register_swiglu(cls: type, gate: str, up: str, down: str) -> None:
    """Declare ``cls`` a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, whose projections are its
    children ``gate``, ``up`` and ``down``."""
    _REGISTERED[cls] = (gate, up, down)


def _hf_swiglu_forward(self, x):  # Hugging Face's LlamaMLP.forward, token for token
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _hf_swiglu_forward_returned(self, x):  # the same, returned directly
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_HF_FORWARDS = {(f.__code__.co_code, f.__code__.co_names) for f in (_hf_swiglu_forward, _hf_swiglu_forward_returned)}


def swiglu_names(module: nn.Module) -> Optional[Tuple[str, str, str]]:
    """The gate, up and down attribute names of a SwiGLU MLP fsdp8 knows, else None."""
    registered = _REGISTERED.get(type(module))
    if registered is not None:
        return registered
    code = getattr(type(module).forward, "__code__", None)
    act = getattr(module, "act_fn", None)
    if (code is not None and (code.co_code, code.co_names) in _HF_FORWARDS
            and type(act).__name__ in ("SiLU", "SiLUActivation") and not (act._forward_hooks or act._forward_pre_hooks)):
        return ("gate_proj", "up_proj", "down_proj")
    return None
