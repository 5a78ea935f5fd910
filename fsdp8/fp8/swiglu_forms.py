"""The SwiGLU MLPs fsdp8 can run as one FP8 function (mlp.py): which child of such an MLP is its
gate, up and down projection. fp8/ knows no model: each model family's adapter registers its way
of recognising its MLPs here (models/adapter.py ``swiglu_names``), the built-in Llama's
``FeedForward`` and Hugging Face's ``LlamaMLP`` form among them."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch.nn as nn

Names = Tuple[str, str, str]
_FORMS: List[Callable[[nn.Module], Optional[Names]]] = []


def register_swiglu_form(recognise: Callable[[nn.Module], Optional[Names]]) -> None:
    """Add ``recognise(module)``: the gate, up and down attribute names of ``module`` when it is a
    SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, else None. The latest registered is asked first."""
    _FORMS.insert(0, recognise)


def swiglu_names(module: nn.Module) -> Optional[Names]:
    """The gate, up and down attribute names of a SwiGLU MLP some registered form recognises, else None."""
    for recognise in _FORMS:
        names = recognise(module)
        if names is not None:
            return names
    return None
