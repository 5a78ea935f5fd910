"""A Hugging Face model directory before transformers reads it: its config.json, checked as JSON
with errors that name the file, and transformers itself, an optional dependency (the [hf] extra)."""

from __future__ import annotations

import json
import os

INSTALL_HF = 'pip install -e ".[hf]"'
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def import_transformers(what: str):
    """The transformers module, or an ImportError in one line saying that ``what`` needs it and
    how to install it (fsdp8 itself installs without it)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{what} needs transformers ({e}); install fsdp8's Hugging Face extra: "
                          f"{INSTALL_HF}") from None
    return transformers


def config_file(path: str) -> str:
    """The config.json of a model directory (or ``path`` itself when it names a .json file)."""
    return path if path.endswith(".json") else os.path.join(path, "config.json")


def read_config(path: str) -> dict:
    """The fields of a model directory's config.json (or of the .json file ``path``). Raises
    FileNotFoundError when it is missing, ValueError naming the file and what is wrong with it
    when it is not a JSON object."""
    file = config_file(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: no such file; give a Hugging Face model directory (its config.json, "
                                "optionally *.safetensors weights and a tokenizer)")
    with open(file, "rb") as f:
        raw = f.read()
    try:
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text (byte {e.start}); give the config.json that save_pretrained "
                         "writes") from None
    except json.JSONDecodeError as e:
        problem = "is empty" if not raw.strip() else f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        raise ValueError(f"{file} {problem}; fix it, or give the config.json that save_pretrained writes") from None
    if not isinstance(config, dict):
        kind = _JSON_KINDS.get(type(config), type(config).__name__)
        raise ValueError(f"{file} holds a JSON {kind}, not an object of config fields "
                         "(\"model_type\", \"hidden_size\", ...); give the config.json that save_pretrained writes")
    return config
