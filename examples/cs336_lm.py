"""Model file: the CS336 course's reference Transformer LM ("BasicsTransformerLM") and its training step, as
the shared GPU snapshots recorded them (../shared/traces/cuda-snapshots), rebuilt here from the facts
PROGRAMS.md gives of them (sections 1 and 2): memplan's own code, importing nothing of the course's. Pre-norm
blocks of RMSNorm (computed in fp32), causal self-attention with interleaved RoPE and a written-out softmax,
and a SwiGLU feed-forward; no biases, an untied LM head, vocabulary 10000; einops for every linear and
rearrange; the course's own cross-entropy (log-softmax written out) and its own AdamW, which makes new
moment tensors every step (the old ones die inside it). The snapshots judge the rebuild: the context-128
step makes the snapshot's allocations in the same order with the same sizes (benchmarks/fidelity.py).

MEMPLAN_PRESET picks the shape: medium (default, GPT-2-medium size: d_model 1024, 24 layers, 16 heads,
d_ff 4096), xl (2560, 32, 32, 10240; 3.4 B parameters, --fake here) or tiny (64, 2, 4, 256: the same program
small enough for a real CPU step in a test). CS336_AUTOCAST=bf16 runs forward and
loss under torch.autocast(bfloat16) on the model's device type, as the context-512 snapshot was recorded.
examples/cs336_xl.py is the xl snapshots' step: this model with PyTorch's AdamW and cross-entropy.
Example: memplan trace examples/cs336_lm.py --batch 4 --seq 128 --fake
"""

import math
import os

import torch
from einops import einsum, rearrange
from torch import nn

VOCAB = 10_000
ROPE_THETA = 10_000.0
PRESETS = {
    "medium": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    "xl": dict(d_model=2560, num_layers=32, num_heads=32, d_ff=10240),
    "tiny": dict(d_model=64, num_layers=2, num_heads=4, d_ff=256),  # the same program at a test's size
}
NAMES = {"medium": "cs336-gpt2-medium", "xl": "cs336-xl", "tiny": "cs336-tiny"}
# The shared snapshots these model files rebuild (PROGRAMS.md, sections 2 and 3), each at batch 4:
# snapshot file -> (model file in examples/, context, CS336_AUTOCAST).
SNAPSHOTS = {
    "gpt2_medium_ctx128_training.pickle": ("cs336_lm.py", 128, ""),
    "gpt2_medium_ctx512_training.pickle": ("cs336_lm.py", 512, "bf16"),
    "xl_ctx128_full_step_none.pickle": ("cs336_xl.py", 128, ""),
    "xl_ctx128_full_step_bf16.pickle": ("cs336_xl.py", 128, "bf16"),
}


def build(batch_size, seq_len, dtype, device):
    """One training step of the preset's BasicsTransformerLM with the course's AdamW and cross-entropy."""
    preset = chosen_preset()
    model = BasicsTransformerLM(vocab_size=VOCAB, context_length=seq_len, **PRESETS[preset])
    x = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    y = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    if os.environ.get("CS336_AUTOCAST") == "bf16":
        model = Autocast(model)
    return {
        "model": model,
        "inputs": x,
        "loss": lambda output, _: autocast(output)(cross_entropy)(output, y),
        "optimizer": AdamW,
        "name": NAMES[preset],
    }


def chosen_preset() -> str:
    preset = os.environ.get("MEMPLAN_PRESET", "medium")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    return preset


def autocast(tensor):
    """torch.autocast(bfloat16) on the tensor's device type when CS336_AUTOCAST=bf16, else nothing."""
    enabled = os.environ.get("CS336_AUTOCAST") == "bf16"
    return torch.autocast(tensor.device.type, dtype=torch.bfloat16, enabled=enabled)


class Autocast(nn.Module):
    """The model with its forward under autocast."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with autocast(x):
            return self.model(x)


# --- the model (PROGRAMS.md, section 1) ------------------------------------------------------------


def truncated_normal(shape, std):
    return nn.init.trunc_normal_(torch.empty(shape), std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T with W (d_out, d_in), no bias."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(truncated_normal((d_out, d_in), math.sqrt(2 / (d_in + d_out))))

    def forward(self, x):
        return einsum(x, self.weight, "... d_in, d_out d_in -> ... d_out")


class Embedding(nn.Module):
    def __init__(self, vocab_size, d_model):
        super().__init__()
        self.weight = nn.Parameter(truncated_normal((vocab_size, d_model), 1.0))

    def forward(self, token_ids):
        return self.weight[token_ids, :]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x * rms
        return (self.weight * x).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Interleaved RoPE; its (cos, sin) table (2, context, dim/2) is a non-persistent buffer."""

    def __init__(self, context_length, dim, theta=ROPE_THETA):
        super().__init__()
        self.register_buffer("_freq_cis_cache", self._init_cache(context_length, dim, theta), persistent=False)

    @staticmethod
    def _init_cache(context_length, dim, theta):
        freqs = theta ** -(torch.arange(0, dim, 2) / dim)
        angles = einsum(torch.arange(context_length), freqs, "t, f -> t f")
        return torch.stack((torch.cos(angles), torch.sin(angles)))

    def forward(self, x):
        x1, x2 = rearrange(x, "... (half xy) -> xy ... half", xy=2)
        cos, sin = self._freq_cis_cache[:, : x.shape[-2], :]
        x1_rot = x1 * cos - x2 * sin
        x2_rot = x1 * sin + x2 * cos
        return torch.cat((x1_rot, x2_rot), dim=-1)


def softmax(x, dim=-1):
    rescaled = x - torch.max(x, dim=dim, keepdim=True)[0]
    exponentiated = torch.exp(rescaled)
    return exponentiated / torch.sum(exponentiated, dim=dim, keepdim=True)


def scaled_dot_product_attention(Q, K, V, mask):
    d_k = K.shape[-1]
    scores = einsum(Q, K, "... query d_k, ... key d_k -> ... query key") / math.sqrt(d_k)
    scores = torch.where(mask, scores, float("-inf"))
    weights = softmax(scores, dim=-1)
    return einsum(weights, V, "... query key, ... key d_v -> ... query d_v")


class CausalMultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, positional_encoder):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.output_proj = Linear(d_model, d_model)
        self.positional_encoder = positional_encoder

    def forward(self, x):
        sequence_length = x.shape[-2]
        Q = self.q_proj(x)
        K = self.k_proj(x)
        V = self.v_proj(x)
        Q = rearrange(Q, "... seq (heads d) -> ... heads seq d", heads=self.num_heads)
        K = rearrange(K, "... seq (heads d) -> ... heads seq d", heads=self.num_heads)
        V = rearrange(V, "... seq (heads d) -> ... heads seq d", heads=self.num_heads)
        Q = self.positional_encoder(Q)
        K = self.positional_encoder(K)
        # the causal mask, made each call
        seq = torch.arange(sequence_length, device=x.device)
        qi = seq[None, None, :, None]
        kj = seq[None, None, None, :]
        causal_mask = qi >= kj
        attn_output = scaled_dot_product_attention(Q, K, V, causal_mask)
        attn_output = rearrange(attn_output, "batch heads seq d_v -> batch seq (heads d_v)").contiguous()
        return self.output_proj(attn_output)


def silu(x):
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x):
        return self.w2(silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, positional_encoder):
        super().__init__()
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder)
        self.ffn = SwiGLU(d_model, d_ff)
        self.ln1 = RMSNorm(d_model)
        self.ln2 = RMSNorm(d_model)

    def forward(self, x):
        x_attn = self.attn(self.ln1(x))
        attn_sublayer_output = x + x_attn
        x_ffn = self.ffn(self.ln2(attn_sublayer_output))
        return attn_sublayer_output + x_ffn


class BasicsTransformerLM(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta=ROPE_THETA):
        super().__init__()
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.positional_encoder = RotaryEmbedding(context_length, d_model // num_heads, rope_theta)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, self.positional_encoder) for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def forward(self, x):
        x = self.token_embeddings(x)
        for layer in self.layers:
            x = layer(x)
        x = self.ln_final(x)
        return self.lm_head(x)


# --- the step (PROGRAMS.md, section 2) ---------------------------------------------------------------


def log_softmax(x, dim=-1):
    x_max = torch.max(x, dim=dim, keepdim=True)[0]
    x = x - x_max
    return x - torch.log(torch.sum(torch.exp(x), dim=dim, keepdim=True))


def cross_entropy(inputs, targets):
    negative_log_softmax_logits = -log_softmax(inputs)
    return torch.mean(torch.gather(negative_log_softmax_logits, -1, targets.unsqueeze(-1)))


class AdamW(torch.optim.Optimizer):
    """The course's AdamW: decoupled weight decay, then new moment tensors m_t and v_t each step (fresh zeros
    made as default values every call), which replace the state's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state.get("t", 1)
                grad = p.grad.data
                p.data -= lr * weight_decay * p.data
                m = state.get("m", torch.zeros_like(grad))
                v = state.get("v", torch.zeros_like(grad))
                m_t = beta1 * m + (1 - beta1) * grad
                v_t = beta2 * v + (1 - beta2) * torch.square(grad)
                lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.data -= lr_t * m_t / (torch.sqrt(v_t) + eps)
                state["m"] = m_t
                state["v"] = v_t
                state["t"] = t + 1
        return loss
