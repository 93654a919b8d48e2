"""A HuggingFace `config.json` as a model file: the model a config describes, trained one step, nothing downloaded.

`memplan trace CONFIG.json` (or a folder holding a config.json) builds the causal LM the config names (its
`architectures` entry, else AutoModelForCausalLM) with random weights, a batch of `--batch` x `--seq` random token
ids as inputs and labels, the model's own loss, and the model file protocol's default optimizer (AdamW). The KV
cache is off (`use_cache=False`): a training step never reads it, and a loop holding the output would keep it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from memplan.errors import ModelFileError

CONFIG_NAME = "config.json"


def config_file(path: str | Path) -> Path | None:
    """The HuggingFace config that `path` names (a .json file, or a folder holding config.json); None for a
    Python model file."""
    path = Path(path)
    if path.is_dir():
        return path / CONFIG_NAME
    return path if path.suffix == ".json" else None


def config_name(config: Path) -> str:
    """The model's name in traces: the file's stem, or its folder's name for a config.json."""
    return config.parent.name if config.name == CONFIG_NAME else config.stem


def load_config(config: Path):
    """The transformers config the file describes; ModelFileError in one line when it is not one."""
    import transformers

    if not config.is_file():
        raise ModelFileError(f"{config}: no such file (a HuggingFace config.json, or a folder holding one)")
    try:
        fields = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{config}: not a JSON config: {e}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ModelFileError(f"{config}: a HuggingFace config names its model_type; this one does not")
    try:
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(f"{config}: transformers {transformers.__version__} cannot read it: {first}") from None


def causal_lm_class(config):
    """The class that builds the model: the config's `architectures` entry when transformers has it, else
    AutoModelForCausalLM's choice for the model_type."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None and name.endswith("ForCausalLM"):
            return cls
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ModelFileError(
            f"model_type {config.model_type!r} has no causal language model in transformers {transformers.__version__}"
        ) from None


def config_build(config: Path) -> Callable:
    """The model file protocol's build() for a HuggingFace config (docs/capture.md: HuggingFace configs)."""
    hf_config = load_config(config)
    model_class = causal_lm_class(hf_config)
    hf_config.use_cache = False

    def build(batch_size: int, seq_len: int, dtype: torch.dtype, device: str) -> dict:
        model = model_class(hf_config).train()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, hf_config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
        return {
            "model": model,
            "inputs": {"input_ids": ids, "labels": ids},
            "loss": lambda output, _: output.loss,
            "name": config_name(config),
        }

    return build
