"""A HuggingFace `config.json` as a model file: the model a config describes, trained one step, nothing downloaded.

`memplan trace CONFIG.json` (or a folder holding a config.json) builds the causal LM the config names (its
`architectures` entry, else AutoModelForCausalLM) with random weights, a batch of `--batch` x `--seq` random token
ids as inputs and labels, the model's own loss, and the model file protocol's default optimizer (AdamW). The KV
cache is off (`use_cache=False`): a training step never reads it, and a loop holding the output would keep it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

import torch

from memplan.errors import ModelFileError
from memplan.files import decode_json, read_input
from memplan.limits import CONFIG_RANGES, MAX_CONFIG_BYTES, MAX_JSON_DEPTH, LimitError, check_nesting, short_repr

CONFIG_NAME = "config.json"
MAX_MESSAGE = 200  # characters of an error transformers raises that one Error: line quotes


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


def read_fields(config: Path) -> dict:
    """The config's JSON object, read under memplan's limits (limits.py: its bytes, its nesting, every shape number's
    range, `architectures` a list of names, a model_type transformers knows); ModelFileError or LimitError in one
    line naming the field otherwise."""
    if not config.is_file():
        raise ModelFileError(f"{config}: no such file (a HuggingFace config.json, or a folder holding one)")
    raw = read_input(config, ModelFileError, limit=MAX_CONFIG_BYTES)
    try:
        fields = decode_json(raw)
        check_nesting(fields, MAX_JSON_DEPTH)
    except ValueError as e:
        raise ModelFileError(f"{config}: not a JSON config: {e}") from None
    except LimitError as e:
        raise LimitError(f"{config}: {e} (limits.MAX_JSON_DEPTH)") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ModelFileError(f"{config}: a HuggingFace config names its model_type; this one does not")
    check_model_type(config, fields["model_type"])
    names = fields.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ModelFileError(
            f"{config}: field 'architectures': expected a list of class names, got {short_repr(names)}"
        )
    check_ranges(config, fields)
    return fields


def check_model_type(config: Path, model_type) -> None:
    """ModelFileError, short, unless `model_type` is a model type the installed transformers knows (its own error
    lists all of them: one line of 12 KB)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    a_name = isinstance(model_type, str)
    if a_name and model_type in CONFIG_MAPPING_NAMES:
        return
    known = f"one of the {len(CONFIG_MAPPING_NAMES)} transformers {transformers.__version__} knows"
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3) if a_name else []
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else " (transformers.CONFIG_MAPPING lists them)"
    raise ModelFileError(f"{config}: model_type {short_repr(model_type)} is not {known}{hint}")


def check_ranges(config: Path, fields: dict, where: str = "") -> None:
    """LimitError naming the field when a number that sets the model's shape (limits.CONFIG_RANGES, in the config or
    a sub-config) is outside its range; other types are left to transformers' own validation."""
    for name, value in fields.items():
        if isinstance(value, dict):
            check_ranges(config, value, f"{where}{name}.")
        elif name in CONFIG_RANGES and isinstance(value, int) and not isinstance(value, bool):
            low, high = CONFIG_RANGES[name]
            if not low <= value <= high:
                raise LimitError(
                    f"{config}: field '{where}{name}' is {short_repr(value)}, outside [{low:,}, {high:,}] "
                    "(limits.CONFIG_RANGES)"
                )


def load_config(config: Path):
    """The transformers config the file describes, read through transformers' own validation; ModelFileError in one
    line naming the field when it is not one."""
    import transformers

    fields = read_fields(config)
    try:
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as e:  # transformers' and huggingface_hub's validation, and its __post_init__ arithmetic
        raise ModelFileError(
            f"{config}: transformers {transformers.__version__} refuses it: {transformers_error(e)}"
        ) from None


def transformers_error(e: Exception) -> str:
    """One short line for an error transformers raised reading or building a config: the field and the cause of a
    strict dataclass's validation error (huggingface_hub), else the exception's type and first line."""
    from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError

    cause = (
        e.__cause__
        if isinstance(e, (StrictDataclassFieldValidationError, StrictDataclassClassValidationError))
        else None
    )
    first = next((line.strip() for line in str(cause or e).splitlines() if line.strip()), "")
    if isinstance(e, StrictDataclassFieldValidationError):
        field = str(e).split("'")[1] if str(e).count("'") >= 2 else "?"
        first = first.removeprefix(f"Field '{field}' ")
        line = f"field '{field}': {first}"
    elif isinstance(e, StrictDataclassClassValidationError):
        line = first or str(e).splitlines()[0]
    else:
        line = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


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


def parameter_count(config: Path, model_class, hf_config) -> int:
    """The parameters of the model `hf_config` describes, built on PyTorch's meta device (no memory, no compute; an
    8-billion-parameter Llama in 0.1 s); ModelFileError in one line when transformers cannot build it."""
    import transformers

    try:
        with torch.device("meta"):
            model = model_class(hf_config)
    except Exception as e:
        raise ModelFileError(
            f"{config}: transformers {transformers.__version__} cannot build the model it describes: "
            f"{transformers_error(e)}"
        ) from None
    return sum(p.numel() for p in model.parameters())


class ConfigBuild:
    """The model file protocol's build() for a HuggingFace config (docs/capture.md: HuggingFace configs), with the
    model's parameter count, known before anything is built (`check_size`)."""

    def __init__(self, config: Path):
        self.config = config
        self.hf_config = load_config(config)
        self.model_class = causal_lm_class(self.hf_config)
        self.hf_config.use_cache = False
        self.parameters = parameter_count(config, self.model_class, self.hf_config)

    def check_size(self, max_parameters: int) -> None:
        """LimitError when the model has more parameters than `max_parameters` (limits.MAX_PARAMETERS by default)."""
        if self.parameters > max_parameters:
            raise LimitError(
                f"{self.config}: the model has {self.parameters:,} parameters, more than --max-parameters "
                f"{max_parameters:,} (limits.MAX_PARAMETERS; raise it to build a model this large)"
            )

    def __call__(self, batch_size: int, seq_len: int, dtype: torch.dtype, device: str) -> dict:
        model = self.model_class(self.hf_config).train()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.hf_config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
        return {
            "model": model,
            "inputs": {"input_ids": ids, "labels": ids},
            "loss": lambda output, _: output.loss,
            "name": config_name(self.config),
        }


def check_model_size(build: Callable, max_parameters: int) -> None:
    """Before a model file's build() is called: LimitError when it is a HuggingFace config's and its model has more
    than `max_parameters` parameters (a Python model file's size is known only once built)."""
    if isinstance(build, ConfigBuild):
        build.check_size(max_parameters)


def config_build(config: Path) -> Callable:
    """The model file protocol's build() for a HuggingFace config: a ConfigBuild, the config read and its model
    counted."""
    return ConfigBuild(config)
