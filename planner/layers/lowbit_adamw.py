"""AdamW whose two moments are kept block-wise quantized, in torchao's state layout (torchao.optim.AdamW8bit and
AdamW4bit, 0.18; arXiv 2110.02861 and 2309.01507), written here in plain torch because torchao's step runs only
under torch.compile (its compiled kernel crashes under FakeTensorMode, and fails with Dynamo off).

The layout, per moment of a parameter of n elements (n at least 4096 and a multiple of the block; any other
parameter keeps both moments whole in its own dtype, as torchao does):
- 8-bit: codes, 1 byte per element; an fp32 scale per block of 256 (the block's largest magnitude); a 256-entry
  fp32 map (bitsandbytes' dynamic tree: signed for the first moment, unsigned for the second);
- 4-bit: codes, two per byte (the first element in the high nibble); an fp32 scale per block of 128; a 16-entry fp32
  map (the signed dynamic tree of 3 exponent bits for the first moment, 1/16 ... 16/16 for the second).
Each holds a 0-d fp32 step counter on the CPU too. The step is torchao's `single_param_adam`: the moments
dequantized to fp32, updated, the parameter updated from the fp32 moments, the moments quantized back (each value
rounds to the nearest map entry of its block's scaled values). It runs over chunks of CHUNK elements, so its fp32
temporaries are a chunk's, as a fused kernel holds none of a whole parameter's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

MIN_QUANTIZED = 4096  # torchao quantizes a moment of at least this many elements that its block divides
CHUNK = 1 << 24  # elements updated at once (a multiple of every block): temporaries of 64 MiB a tensor
MOMENTS = ("exp_avg", "exp_avg_sq")  # the first moment's map is signed, the second's unsigned


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> tuple[float, ...]:
    """bitsandbytes' dynamic quantization map as torchao builds it (quant_utils.create_dynamic_map): sorted values
    in [-1, 1] (signed) or [0, 1], denser near zero; computed with torch on the CPU, as torchao does, so the values
    are its to the bit."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        exponent = i + non_sign_bits - max_exponent_bits
        fraction_items = int(2**exponent + 1 if signed else 2 ** (exponent + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data += [0, 1.0]
    assert len(data) == 2**total_bits
    return tuple(sorted(data))


@dataclass(frozen=True)
class Layout:
    """One of torchao's quantized moment layouts: bits per element, elements per scale, and how its maps are made."""

    bits: int  # 8 or 4
    block: int  # elements per fp32 scale

    @property
    def map_size(self) -> int:
        """Entries of each moment's map (2**bits)."""
        return 1 << self.bits

    def quantizes(self, numel: int) -> bool:
        """Whether a parameter of `numel` elements gets quantized moments (torchao's rule), not whole ones."""
        return numel >= MIN_QUANTIZED and numel % self.block == 0

    def moment_bytes(self, numel: int, itemsize: int) -> int:
        """Bytes one moment of a parameter of `numel` elements of `itemsize` bytes holds: codes, scales and map, or
        the whole moment in the parameter's dtype."""
        if not self.quantizes(numel):
            return numel * itemsize
        return numel * self.bits // 8 + 4 * (numel // self.block) + 4 * self.map_size

    def qmap(self, signed: bool) -> tuple[float, ...]:
        """The map of the first moment (signed) or the second, torchao's values."""
        return _qmap(self.bits, signed)

    def max_error(self, signed: bool) -> float:
        """The largest distance from a value of the scaled range ([-1, 1] or [0, 1]) to the map entry it rounds to:
        a quantized moment is within this times its block's scale of the fp32 one it stands for."""
        values = self.qmap(signed)
        low = -1.0 if signed else 0.0
        gaps = [(b - a) / 2 for a, b in zip(values, values[1:], strict=False)]
        return max([*gaps, values[0] - low, 1.0 - values[-1]])


@functools.cache
def _qmap(bits: int, signed: bool) -> tuple[float, ...]:
    with unset_fake_temporarily():  # the map is data, built from real values even inside a fake step
        if bits == 8:
            return dynamic_map(signed)
        if signed:
            return dynamic_map(True, 3, 4)
        return tuple(torch.linspace(0, 1, 17)[1:].tolist())  # no zero: the second moment's 1/16 ... 1


LAYOUTS = {8: Layout(8, 256), 4: Layout(4, 128)}


def _codes(x: Tensor, qmap: Tensor) -> Tensor:
    """The nearest map entry's index for each value of `x` (scaled into the map's range): torchao's branchless
    binary search and rounding, so ties go the same way (in int32 rather than its int64: the same indices, half the
    temporaries)."""
    top = qmap.numel()
    codes = (x >= qmap[top // 2]).int().mul_(top // 2)
    step = top // 4
    while step:
        codes.add_((x >= qmap[codes + step]).int(), alpha=step)
        step //= 2
    codes_up = (codes + 1).clamp_(max=top - 1)
    val_down, val_up = qmap[codes], qmap[codes_up]
    return torch.where(x - val_down >= (val_up - val_down) * 0.5, codes_up, codes).to(torch.uint8)


def quantize(x: Tensor, layout: Layout, qmap: Tensor) -> tuple[Tensor, Tensor]:
    """(codes, scales) of the flat fp32 `x` (its length a multiple of the block): each block scaled by its largest
    magnitude (at least 1e-12), each value coded as its nearest map entry, 4-bit codes packed two per byte."""
    blocks = x.view(-1, layout.block)
    scale = blocks.abs().amax(-1).clip(1e-12)
    codes = _codes((blocks / scale.view(-1, 1)).view(-1), qmap)
    if layout.bits == 4:
        codes = (codes[::2] << 4) | codes[1::2]
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor, layout: Layout, qmap: Tensor) -> Tensor:
    """The flat fp32 values that `codes` and `scale` stand for."""
    if layout.bits == 4:
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    return (qmap[codes.int()].view(scale.numel(), -1) * scale.view(-1, 1)).view(-1)


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW (or Adam, `decoupled=False`) with torchao's quantized moments: `bits` 8 or 4 (module docstring)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        bits: int = 8,
        decoupled: bool = True,
    ) -> None:
        if bits not in LAYOUTS:
            raise ValueError(f"bits={bits}: choose one of {', '.join(map(str, LAYOUTS))}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.layout = LAYOUTS[bits]
        self.decoupled = decoupled

    def _new_state(self, p: Tensor) -> dict[str, Tensor]:
        state = {"step": torch.tensor(0.0)}  # on the CPU, as torchao's
        for name, signed in zip(MOMENTS, (True, False), strict=True):
            if not self.layout.quantizes(p.numel()):
                state[name] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                continue
            n = p.numel()
            state[f"{name}_codes"] = torch.zeros(n * self.layout.bits // 8, dtype=torch.uint8, device=p.device)
            state[f"{name}_scale"] = torch.zeros(n // self.layout.block, device=p.device)
            state[f"{name}_qmap"] = torch.tensor(self.layout.qmap(signed), dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient (torchao's update, over chunks)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LowBitAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(self._new_state(p))
                state["step"] += 1
                self._update(p, p.grad, state, group)
        return loss

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        layout, step = self.layout, state["step"]
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        correction1, correction2 = 1 - beta1**step, (1 - beta2**step).sqrt()
        quantized = "exp_avg" not in state
        flat_p, flat_grad = p.detach().view(-1), grad.reshape(-1)
        whole = None if quantized else (state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
        per_byte = 8 // layout.bits
        for start in range(0, p.numel(), CHUNK):
            stop = min(p.numel(), start + CHUNK)
            p32, g32 = flat_p[start:stop].float(), flat_grad[start:stop].float()
            if wd and self.decoupled:
                p32 = p32 - lr * wd * p32
            elif wd:
                g32 = g32 + wd * p32
            if quantized:
                codes = slice(start // per_byte, stop // per_byte)
                scales = slice(start // layout.block, stop // layout.block)
                m, v = (
                    dequantize(state[f"{n}_codes"][codes], state[f"{n}_scale"][scales], layout, state[f"{n}_qmap"])
                    for n in MOMENTS
                )
            else:
                m, v = (t[start:stop].float() for t in whole)
            m = m.lerp(g32, 1 - beta1)
            v = v.lerp(g32.square(), 1 - beta2)
            if quantized:
                for name, value in zip(MOMENTS, (m, v), strict=True):
                    c, s = quantize(value, layout, state[f"{name}_qmap"])
                    state[f"{name}_codes"][codes].copy_(c)
                    state[f"{name}_scale"][scales].copy_(s)
            else:
                whole[0][start:stop].copy_(m)
                whole[1][start:stop].copy_(v)
            p32 = p32 - lr * (m / correction1) / (v.sqrt() / correction2 + eps)
            flat_p[start:stop].copy_(p32)

    def moments(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """The fp32 first and second moments that `p`'s state stands for, shaped as `p` (for checks)."""
        state = self.state[p]
        if "exp_avg" in state:
            return state["exp_avg"].float(), state["exp_avg_sq"].float()
        return tuple(
            dequantize(state[f"{n}_codes"], state[f"{n}_scale"], self.layout, state[f"{n}_qmap"]).view_as(p)
            for n in MOMENTS
        )


def state_bytes(numel: int, itemsize: int, bits: int) -> int:
    """Bytes of a LowBitAdamW's state for one parameter: both moments and the 4-byte step counter."""
    return 2 * LAYOUTS[bits].moment_bytes(numel, itemsize) + 4
