"""Every causal LM the installed transformers ships, built tiny from its default config with eager attention
(hf_tiny.py): under tempo, which swaps only what a probe proves computes the same function, the loss, logits and
gradients equal the model as built, and no Transformer layer holds more for backward than as built."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import architectures, build, inputs  # noqa: E402  (needs transformers)
from lanes import some  # noqa: E402

from memplan.planner.layers import patch, transformer_layers  # noqa: E402

FAST = ("llama", "qwen3", "gemma2", "gpt_oss", "olmo2", "phi3", "bert", "gpt2")  # the fast lane's sample


def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Loss, logits, gradients and the bytes each Transformer layer's forward saves for backward (storages counted
    once, where first saved)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # routers that draw in training (PhiMoE's sparse mixer) draw alike
    named = dict(model.named_modules())
    held, seen, current, hooks = {}, set(), [], []
    for path in transformer_layers(model):
        hooks.append(named[path].register_forward_pre_hook(lambda m, a, path=path: current.append(path) and None))
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
    return out.loss.detach(), out.logits.detach(), gradients, held


@pytest.mark.parametrize("kind", some(architectures(), fast=FAST))
def test_tempo_equals_the_model_as_built_and_holds_no_more(kind):
    torch.set_num_threads(1)
    try:
        model = build(kind, attention="eager")
        reference = step(model)
    except Exception as error:  # noqa: BLE001 - the model itself does not run at the sweep's sizes
        pytest.skip(f"{kind} does not run as built at the sweep's sizes: {type(error).__name__}: {error}"[:300])
    report = patch(model, "tempo")
    loss, logits, gradients, held = step(model)
    # 1. The same function: loss, logits and every gradient.
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, reference[1], rtol=1e-4, atol=1e-5 * reference[1].abs().max().item())
    assert gradients.keys() == reference[2].keys()
    scale = max(g.abs().max().item() for g in reference[2].values())
    worst = max((gradients[k] - g).abs().max().item() for k, g in reference[2].items())
    assert worst <= 1e-4 * scale, f"{kind}: gradients differ by {worst / scale:.2e} of their scale; {report}"
    # 2. No layer holds more for backward.
    raised = {path: (reference[3].get(path, 0), n) for path, n in held.items() if n > reference[3].get(path, 0)}
    assert not raised, f"{kind}: tempo holds more in {raised}; {report}"
