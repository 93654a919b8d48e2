"""Every causal language model the installed transformers ships, built tiny from its default config: the
architecture sweep of the layer modes (tests/test_patch_architectures.py, benchmarks/architectures.py)."""

from __future__ import annotations

import torch
import transformers

from memplan.planner.layers import transformer_layers

transformers.logging.set_verbosity_error()

SIZES = {  # the config keys (under their many names) made small; others keep their defaults
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "sliding_window": 8,
    "mamba_chunk_size": 16,  # the sequence, one chunk, as 256 was (which padded it to 256: Falcon-H1 took 16 s)
}
MAX_PARAMETERS = 12_000_000  # larger even at these sizes (a vision tower, an audio codec): not a decoder sweep's
BATCH, SEQUENCE = 2, 16


def architectures() -> list[str]:
    """The model types of every causal LM the installed transformers ships."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(kind: str):
    """`kind`'s default config with SIZES where it has those keys (latent attention keeps its head dims),
    vocabularies of 256, token ids inside them, its layer types cut to the fewest layers that hold each type once,
    no dropout."""
    config = transformers.AutoConfig.for_model(kind)
    present = config.to_dict()
    sizes = {**SIZES, **{k: 256 for k, v in present.items() if "vocab_size" in k and isinstance(v, int) and v > 256}}
    if "kv_lora_rank" in present:  # multi-head latent attention: its own head dims, one k/v per head
        sizes.pop("head_dim")
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    for key, value in sizes.items():
        if key in present:
            settle(config, key, value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(present.get(key), int) and present[key] >= 256:
            settle(config, key, {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2))
    for key in ("layer_types", "layers_block_type"):
        types = present.get(key)
        if isinstance(types, list) and types:
            count = next(n for n in range(2, len(types) + 1) if set(types[:n]) == set(types) or n == len(types))
            settle(config, key, types[:count])
            settle(config, "num_hidden_layers", count)
    for key, value in present.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            settle(config, key, 0.0)
    return config


def settle(config, key: str, value) -> None:
    """Set `key` on `config`, unless it is a property computed from others."""
    try:
        setattr(config, key, value)
    except AttributeError:
        pass


def build(kind: str, attention: str | None = None) -> torch.nn.Module:
    """`kind` built tiny (with the attention implementation `attention`, else its default), fp32, in training mode,
    from a fixed seed; ValueError when it is too large for a sweep."""
    config = tiny_config(kind)
    if attention is not None:
        config._attn_implementation = attention
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count:,} parameters at the sweep's sizes")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().train()


def inputs() -> dict:
    """A batch of token ids, its own labels."""
    ids = torch.randint(1, 200, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Loss, logits, gradients and the bytes each Transformer layer's forward saves for backward (storages counted
    once, where first saved)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # routers that draw in training (PhiMoE's sparse mixer) draw alike
    named = dict(model.named_modules())
    held, seen, current, hooks = {}, set(), [], []
    for path in transformer_layers(model):
        hooks.append(named[path].register_forward_pre_hook(lambda m, a, path=path: current.append(path)))
        # `and None`: a forward hook's result would replace the layer's output
        hooks.append(named[path].register_forward_hook(lambda m, a, out: current.pop() and None))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            where = current[-1] if current else "outside"
            held[where] = held.get(where, 0) + storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(**inputs())
    finally:
        for hook in hooks:
            hook.remove()
    out.loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    logits = None if out.logits is None else out.logits.detach()  # None under the fused loss
    return out.loss.detach(), logits, gradients, held
