"""Building blocks shared by the decoder models: RMSNorm, rotary embeddings, the gated MLP.

Tensors are flat over the step's tokens: (num_tokens, ...); there is no batch dimension in the runner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from serval.runner.kernels import packed_rows_limit, quantized_matmul
from serval.runner.models.arch import RopeScaling
from serval.runner.quantization import PackedParts, PackedWeight

if TYPE_CHECKING:
    from serval.runner.lora import LoraBatch, LoraTarget


class RMSNorm(nn.Module):
    native_kernel = None  # kernels.rms_norm, set by use_native_kernels

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 whatever comes in; the result is in the weights' (the model's compute) dtype, so
        # an fp32 residual stream feeds bf16 matmuls directly.
        if self.native_kernel is not None:
            return self.native_kernel(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(self.weight.dtype)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:  # (head_dim // 2,) float32
    # On the CPU even while a model is built on the meta device: a factory op there goes through torch's
    # Python refs, whose first use imports torch._dynamo (~2 s of every start).
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if freq_factors is not None:
        # GGUF files of Llama 3.1 carry the llama3 scaling baked into per-frequency divisors.
        return (inv_freq / freq_factors.to(torch.float64)).float()
    if scaling is None:
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def _yarn_inverse_frequencies(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling
) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    # (divided by factor), those that turn more than beta_fast times kept, a linear ramp between.
    def dim_of(rotations: float) -> float:  # the rotary dim that turns `rotations` times over the context
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one dim, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return (inv_freq / scaling.factor * (1 - kept) + inv_freq * kept).float()


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """YaRN's scale of cos and sin (so of every attention logit, squared); 1 for the other kinds."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


@dataclass
class RopeTables:
    """One step's rotary tables: looked up once per step, applied by every layer."""

    cos: torch.Tensor  # (num_tokens, head_dim // 2) float32
    sin: torch.Tensor
    dtype: torch.dtype  # of q and k
    native_kernel: Callable | None  # kernels.rotary_embedding_ (in place, fp32 math)
    interleaved: bool = False  # dims (2i, 2i+1) turn together (GLM-4), not (i, i + dim / 2) (neox)

    def __post_init__(self) -> None:
        if self.native_kernel is None:
            # (num_tokens, 1, head_dim // 2) in the compute dtype, for the broadcasting PyTorch path
            self.cos_b = self.cos.unsqueeze(1).to(self.dtype)
            self.sin_b = self.sin.unsqueeze(1).to(self.dtype)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_dim = 2 * self.cos.shape[-1]
        if rotary_dim < q.shape[-1]:  # partial RoPE: each head's first rotary_dim dims turn, the rest pass
            q_rot, k_rot = self.apply(q[..., :rotary_dim], k[..., :rotary_dim])
            if self.native_kernel is not None:  # turned in place, through the views
                return q, k
            return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat(
                (k_rot, k[..., rotary_dim:]), dim=-1
            )
        if self.native_kernel is not None:
            self.native_kernel(q, k, self.cos, self.sin)
            return q, k
        rotate = apply_interleaved_rope if self.interleaved else apply_rope
        return rotate(q, self.cos_b, self.sin_b), rotate(k, self.cos_b, self.sin_b)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate halves) RoPE with a precomputed cos/sin table indexed by position, over the first
    2 x len(inv_freq) dims of each head; interleaved: GLM-4's pairs of adjacent dims (PyTorch only: the
    native kernel turns halves)."""

    native_kernel = None  # kernels.rotary_embedding_, set by use_native_kernels

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        inv_freq: torch.Tensor,
        attention_factor: float = 1.0,
        interleaved: bool = False,
    ):
        super().__init__()
        self.interleaved = interleaved
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq)  # (max_positions, head_dim // 2)
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        kernel = None if self.interleaved else self.native_kernel
        return RopeTables(self.cos[positions], self.sin[positions], dtype, kernel, self.interleaved)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (num_tokens, num_heads, head_dim); rotate the two halves of head_dim.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (num_tokens, num_heads, dim); dims 2i and 2i+1 turn by frequency i (transformers' GLM-4).
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


# Weight dtypes kernels.dense_linear takes (x in the compute dtype, fp32 sums).
DENSE_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes_dense_kernel(weight: torch.Tensor, deterministic: bool) -> bool:
    """Whether a dense (unpacked) weight goes through kernels.dense_linear, a row's bits the same at every
    row count: fp32 and fp16 ones always (faster than PyTorch's GEMM at every count up to 64 rows, 0.96-1.4x
    at 512), bf16 ones only when `deterministic` (ModelConfig.deterministic): oneDNN's bf16 GEMM made whole
    decode steps of 64 rows 1.16x as fast (docs/architecture.md, "Batch invariance")."""
    is_dense = weight.device.type == "cpu" and weight.dtype in DENSE_KERNEL_DTYPES
    return is_dense and (deterministic or weight.dtype != torch.bfloat16)


class Linear(nn.Linear):
    """nn.Linear that sends its rows to native kernels when they are set: the quantized kernel when the weight
    has an exact packed low-bit form (runner/quantization.py), else the dense kernel (every row count: each
    row summed over K in one order, so its bits never depend on the batch), else, for a few rows, the bf16
    small-batch kernel; and adds the LoRA deltas of the step's adapters when it has adapter slots and the step
    uses any.

    The loader sets `packed`, the runner sets the kernels after loading (`use_native_kernels`) and
    `lora_target` when LoRA is enabled (runner/lora.py); without them this is exactly nn.Linear.
    """

    MAX_KERNEL_ROWS = 8
    small_batch_kernel = None
    dense_kernel = None  # kernels.dense_linear for dense weights (not packed), set by use_native_kernels
    quantized_kernel = None  # kernels.quantized_linear, set only when `packed` is
    max_quantized_rows = 0  # the packed path's row limit (kernels.packed_rows_limit), set with it
    packed: PackedWeight | PackedParts | None = None
    lora_target: LoraTarget | None = None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        y = small_batch_linear(
            x,
            self.weight,
            self.small_batch_kernel,
            self.packed,
            self.quantized_kernel,
            self.max_quantized_rows,
            self.dense_kernel,
        )
        if y is None:
            y = F.linear(x, self.weight, self.bias)
        elif self.bias is not None:
            y = y + self.bias
        if lora is not None and self.lora_target is not None:
            self.lora_target.add_delta(y, x, lora)
        return y


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    kernel,
    packed: PackedWeight | PackedParts | None = None,
    quantized_kernel=None,
    max_quantized_rows: int = 0,
    dense_kernel=None,
) -> torch.Tensor | None:
    """x @ weight.T through a native kernel when x has few enough rows for one (the packed kernel: up to
    max_quantized_rows; the dense kernel: any count); None: use PyTorch's."""
    if x.dim() != 2:
        return None
    if quantized_kernel is not None and packed is not None and x.shape[0] <= max_quantized_rows:
        return packed.matmul(quantized_kernel, x)
    if dense_kernel is not None:
        return dense_kernel(x, weight)
    if kernel is not None and x.shape[0] <= Linear.MAX_KERNEL_ROWS:
        return kernel(x, weight)
    return None


def packed_logits(
    x: torch.Tensor,
    packed: PackedWeight | PackedParts | None,
    quantized_kernel,
    max_quantized_rows: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """fp32 logits from a packed LM head, or None where it is not packed or x has too many rows for it. x,
    the final norm's output in the model's dtype, goes in widened to fp32: the same values, so the same
    rounding to int8 or int16, and the products come out as computed instead of rounded to bf16 and widened
    again. That drops two passes over the logits (64 x 49152 of them a decode step of the default model: ~3%
    of it, `perf`), and bf16's spacing of 0.125 between logits of 16-32 no longer makes ties for greedy picks."""
    if packed is None or quantized_kernel is None or x.shape[0] > max_quantized_rows:
        return None
    logits = packed.matmul(quantized_kernel, x.float())
    return logits if bias is None else logits + bias.float()


def use_native_kernels(
    model: nn.Module,
    kernels,
    int8_batch_activations: bool = False,
    deterministic: bool = False,
    invariant_dense: bool = True,
) -> None:
    """Point the model's layers at the native CPU kernels (None: back to plain PyTorch everywhere).

    The quantized kernel is used only for packed weights, the dense kernel for the others where
    takes_dense_kernel says (invariant_dense: False only to time the path it replaced, bench/decode_step.py:
    PyTorch's GEMM, whose order over K follows the row count, and the bf16 small-batch kernel for a few
    rows); norms and SwiGLU take bf16 or fp32.
    int8_batch_activations: the quantized kernel rounds x to int8 over 4-bit codes, and Q8_0's or 5- and 6-bit
    ones where the build has them (every row count wherever AVX2 is: kernels.int8_rows_from;
    `--batch-activations int8`).
    """
    for module in model.modules():
        if isinstance(module, Linear):
            usable = kernels is not None and module.in_features % 32 == 0
            is_bf16 = module.weight.dtype == torch.bfloat16
            module.small_batch_kernel = kernels.bf16_linear_small_batch if usable and is_bf16 else None
            is_dense = module.packed is None and takes_dense_kernel(module.weight, deterministic)
            use_dense = kernels is not None and invariant_dense and is_dense
            module.dense_kernel = kernels.dense_linear if use_dense else None
            has_quantized = kernels is not None and module.packed is not None
            module.quantized_kernel = (
                quantized_matmul(kernels, int8_batch_activations) if has_quantized else None
            )
            module.max_quantized_rows = packed_rows_limit(kernels) if has_quantized else 0
        elif isinstance(module, RMSNorm):
            module.native_kernel = None if kernels is None else kernels.rms_norm
        elif isinstance(module, GatedMLP):
            module.silu_mul_kernel = None if kernels is None else kernels.silu_mul
        elif isinstance(module, RotaryEmbedding):
            module.native_kernel = None if kernels is None else kernels.rotary_embedding_


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one matmul."""

    silu_mul_kernel = None  # kernels.silu_mul, set by use_native_kernels

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if self.silu_mul_kernel is not None:
            return self.down_proj(self.silu_mul_kernel(gate_up), lora)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)
