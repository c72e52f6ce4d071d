"""``weights_dtype=int8``: linear layers with int8 weights (per output channel) whose activations
are quantized per row (per token), on the fly, over fbgemm (CPU).

torch's dynamic quantization (``torch.ao``'s ``quantize_dynamic``) quantizes a product's whole
input with one scale, in 7 bits (``reduce_range``): in a prefill chunk, the tokens whose hidden
states carry outlier values set the scale for every other token, whose values are then rounded
to a few levels. On 512-token prompts through chunked prefill it multiplied perplexity by 2.2-3.3
against float32. Here each row gets its own scale, by a trick that keeps fbgemm's fast int8
kernel: the rows are divided by their own max |x| before the op (which then sees one range,
[-1, 1], for all of them, quantized over 8 bits) and the output rows multiplied back. A row's
result thus depends on that row only, not on which other tokens share the step (a single row,
a decode step at batch 1, needs no rescaling: the op's own range is that row's). The full 8-bit
range is used where this CPU's kernel computes it exactly (checked once at load:
:func:`full_range_is_exact`; fbgemm's AVX2 path without VNNI can saturate int16 sums, then the
7-bit range is kept). Measured in ``perf/bench_int8_kernels.py`` and ``perf/bench_formats.py``.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_EPS = 1e-12
log = logging.getLogger("triton_disagg.engine")


def _packed(weight: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's prepacked form of ``weight`` ([out, in], float) in int8, one scale per output
    channel (symmetric), no bias."""
    scales = weight.abs().amax(dim=1).clamp_min(_EPS) / 127
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated (for torchao)
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(weight.float().contiguous(), scales.double(), zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qweight, None)


# The quantized op's input (each row divided by its max |x|, so in [-1, 1]) as uint8: value / scale
# + zero point, symmetric around it. 8 bits: [-1, 1] onto 1..255; 7 bits (fbgemm's reduce_range,
# for kernels whose int16 pair sums could saturate): onto 1..127.
FULL_RANGE, REDUCED_RANGE = (1 / 127, 128), (1 / 63, 64)


def _fixed_range_product(x: torch.Tensor, packed: torch.ScriptObject, quant: tuple[float, int]) -> torch.Tensor:
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, quant[0], quant[1], packed)


@functools.cache
def full_range_is_exact() -> bool:
    """Whether fbgemm's int8 op computes 8-bit activations without saturating: a product whose
    int16 pair sums would overflow on a kernel without VNNI (every activation at the top of
    the range, every weight at 127) compared with the exact float result."""
    k = 64
    weight = torch.ones(4, k)
    x = torch.ones(2, k)
    y = _fixed_range_product(x, _packed(weight), FULL_RANGE)
    return bool(torch.allclose(y, x @ weight.t(), rtol=0.02))


class Int8Linear(nn.Module):
    """A linear layer with int8 weights, per output channel, and activations quantized per row
    (see the module's docstring). ``product()`` is its forward as a plain function (the lean
    layer loop calls it without the module call)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self._packed_weight = _packed(linear.weight.detach())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.quant = FULL_RANGE if full_range_is_exact() else REDUCED_RANGE
        self._forward = self.product()

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        op, packed, (scale, zero_point), bias = (
            torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default,
            self._packed_weight,
            self.quant,
            self.bias,
        )

        def forward(x: torch.Tensor) -> torch.Tensor:
            row_max = x.abs().amax(dim=-1, keepdim=True).clamp_min_(_EPS)
            y = op(x / row_max, scale, zero_point, packed).mul_(row_max)
            return y if bias is None else y + bias

        return forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, quant={self.quant}"


class RotatedRMSNorm(nn.Module):
    """The model's final norm behind a rotated residual stream (:func:`rotate_residual_stream`):
    turns the hidden states back (``h @ rotation.T``) before normalizing, so that the final
    hidden states and the LM head are the unrotated model's."""

    rotation: torch.Tensor

    def __init__(self, norm: Any, rotation: torch.Tensor):
        super().__init__()
        self.norm: nn.Module = norm
        self.weight = norm.weight  # what the lean loop's final norm reads
        self.register_buffer("rotation", rotation, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden @ self.rotation.t())


def rotation_unsupported(model: nn.Module) -> str | None:
    """None when :func:`rotate_residual_stream` applies to ``model``: Llama-family layers whose
    norms multiply by their weight (``RMSNorm``), with separate or fused projections."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm")):
        return f"{type(model).__name__} has no decoder layers, embedding and final norm"
    if not hasattr(model, "lm_head"):
        return "no LM head"
    for layer in inner.layers:
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if not all(n is not None and type(n).__name__.endswith("RMSNorm") for n in norms + [inner.norm]):
            return "a norm that is not an RMSNorm"
        if "Gemma" in type(norms[0]).__name__:  # Gemma's norms multiply by 1 + weight
            return "Gemma's RMSNorm"
        try:
            _readers(layer), _writers(layer)
        except AttributeError as e:
            return f"a layer that differs from a Llama layer ({e})"
    return None


def _readers(layer: Any) -> list[tuple[Any, list[Any]]]:
    """(norm, the projections that read its output) of a Llama-family layer."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return [(layer.input_layernorm, qkv), (layer.post_attention_layernorm, gate_up)]


def _writers(layer: Any) -> list[Any]:
    """The projections whose output is added to the residual stream."""
    return [layer.self_attn.o_proj, layer.mlp.down_proj]


def residual_rotation(size: int, seed: int = 0) -> torch.Tensor:
    """A fixed random orthogonal matrix (float64): QR of a seeded Gaussian one, signs fixed."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@torch.no_grad()
def rotate_residual_stream(model: nn.Module) -> torch.Tensor:
    """Rotate the residual stream of ``model`` (a Llama-family causal LM, float weights, in place)
    by a fixed orthogonal matrix Q: the same function in exact arithmetic, but the inputs of the
    projections that read the stream carry no outlier features any more (an outlier channel is
    spread over all of them), which per-row int8 activations then resolve (QuaRot, SpinQuant).
    Each norm's weight goes into the projections that read its output (the norm keeps weight 1,
    and normalizing commutes with Q); those projections become ``W diag(g) Q``, those that write to
    the stream ``Q^T W``, the embedding ``E Q``; the final norm turns the stream back before
    normalizing (:class:`RotatedRMSNorm`), so the LM head (untied from the embedding) and the
    returned hidden states are unchanged. Returns Q (float32)."""
    inner: Any = model.model  # nn.Module types submodule attributes as Tensor | Module
    config: Any = model.config
    rotation = residual_rotation(config.hidden_size)

    def set_weight(module: Any, weight: torch.Tensor) -> None:
        module.weight = nn.Parameter(weight.to(module.weight.dtype), requires_grad=False)

    for layer in inner.layers:
        for norm, projections in _readers(layer):
            gain = norm.weight.double()
            for linear in projections:
                set_weight(linear, (linear.weight.double() * gain) @ rotation)
            set_weight(norm, torch.ones_like(norm.weight))
        for linear in _writers(layer):
            set_weight(linear, rotation.t() @ linear.weight.double())
            if linear.bias is not None:
                linear.bias = nn.Parameter((linear.bias.double() @ rotation).to(linear.bias.dtype), requires_grad=False)
    set_weight(inner.embed_tokens, inner.embed_tokens.weight.double() @ rotation)  # unties a tied LM head
    inner.norm = RotatedRMSNorm(inner.norm, rotation.float())
    return inner.norm.rotation


def quantize_linear_int8(model: nn.Module) -> nn.Module:
    """``weights_dtype=int8``: the residual stream of ``model`` rotated (:func:`rotate_residual_stream`,
    unless done already or the model's layers do not fit it), then every ``nn.Linear`` (the LM head
    included) replaced in place by :class:`Int8Linear`."""
    inner = getattr(model, "model", None)
    if not isinstance(getattr(inner, "norm", None), RotatedRMSNorm):
        reason = rotation_unsupported(model)
        if reason is None:
            rotate_residual_stream(model)
        else:
            log.info("int8: residual stream not rotated (%s); per-row int8 activations only", reason)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model
