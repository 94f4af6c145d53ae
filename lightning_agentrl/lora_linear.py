"""A LoRA linear layer whose adapter runs fused into the frozen base's matmuls: the same numbers as peft's, fewer ops.

Why: peft computes an adapted layer as ``base(x) + lora_B(lora_A(dropout(x))) * s``, four modules whose autograd
graph adds, per layer and step, an elementwise scale and an add over the whole ``[N, out]`` output in the forward
pass and their mirror images plus a second ``[N, in]`` add in the backward pass. On SmolLM2-135M (210 adapted
layers, 1,024 tokens, one CPU thread) that bookkeeping around the rank-8 matmuls is about a tenth of a LoRA step.
:class:`FusedLoraFunction` writes the adapter's contribution into the base's output and input gradient in place
(``addmm_``), with the scale folded into the matmul, and computes no gradient for the frozen ``W`` and ``b``.

Shapes: N tokens (all leading dimensions of ``x`` flattened), k = in features, d = out features, r = rank,
``s = alpha / r``. The rank-r intermediates are kept as ``[r, N]`` rows (``uᵀ``, ``vᵀ``): each product then reads its
large ``[N, ·]`` operand in the order it is stored, where ``x Aᵀ`` or ``dyᵀ u`` ([N, r] outputs, [d, r] from a
transposed ``dy``) run a skinny matmul at a third to a fifth of that speed on one CPU thread::

    forward    uᵀ = A xᵀ                [r, N]     (x [N, k], A [r, k])
               y = x Wᵀ + b + s u Bᵀ    [N, d]     (W [d, k], b [d], B [d, r])
    backward   vᵀ = Bᵀ dyᵀ              [r, N]     (dy [N, d])
               dx = dy W + s v A        [N, k]
               dA = s vᵀ x              [r, k]
               dB = s (uᵀ dy)ᵀ          [d, r]

:class:`FusedLoraLinear` (peft's ``lora.Linear``, made by peft itself through ``LoraConfig._register_custom_module``)
takes this path only where it is peft's computation exactly: one active adapter, not merged, adapters enabled,
no dropout, no variant (DoRA ...), no LoRA bias, a frozen base, one float dtype throughout (over a bfloat16 base peft
keeps the adapters in float32 and casts between the two), no autocast, and a base whose weight is whole. Under
DeepSpeed ZeRO-3 the weight is a partition gathered by hooks around ``base_layer``'s own forward (and again for its
backward), which a function reading ``base_layer.weight`` directly would bypass. There, and in every other case,
the layer runs peft's forward. Its state (names, parameters, the ``adapter/`` folder) is peft's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as PeftLoraLinear


class FusedLoraFunction(torch.autograd.Function):
    """``y = x Wᵀ + b + s (x Aᵀ) Bᵀ`` with gradients for ``x``, ``A`` and ``B`` only (formulas: module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        rows = x.reshape(-1, x.shape[-1])  # [N, k]
        y = F.linear(rows, weight, bias)  # [N, d]
        u_t = lora_a @ rows.t()  # [r, N]
        y.addmm_(u_t.t(), lora_b.t(), alpha=scaling)
        ctx.save_for_backward(rows, weight, lora_a, lora_b, u_t)
        ctx.scaling, ctx.x_shape = scaling, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        rows, weight, lora_a, lora_b, u_t = ctx.saved_tensors
        s = ctx.scaling
        dy = dy.reshape(-1, dy.shape[-1])  # [N, d]
        v_t = lora_b.t() @ dy.t()  # [r, N]
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ weight).addmm_(v_t.t(), lora_a, alpha=s).view(ctx.x_shape)
        if ctx.needs_input_grad[3]:
            da = (v_t @ rows).mul_(s)  # [r, k]
        if ctx.needs_input_grad[4]:
            db = (u_t @ dy).mul_(s).t().contiguous()  # [d, r]
        return dx, None, None, da, db, None


class FusedLoraLinear(PeftLoraLinear):
    """peft's LoRA ``Linear``, running :class:`FusedLoraFunction` where that is exactly peft's computation."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not self.fusable(x):
            return super().forward(x, *args, **kwargs)
        (adapter,) = self.active_adapters
        base = self.get_base_layer()
        return FusedLoraFunction.apply(x, base.weight, base.bias, self.lora_A[adapter].weight,
                                       self.lora_B[adapter].weight, self.scaling[adapter])

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether this call is peft's plain LoRA (module docstring), so the fused function computes the same."""
        if self.disable_adapters or self.merged or self.fan_in_fan_out or len(self.active_adapters) != 1:
            return False
        adapter = self.active_adapters[0]
        variant = adapter in getattr(self, "lora_variant", {}) or self.use_dora.get(adapter, False)  # older peft
        if adapter not in self.lora_A or variant or getattr(self, "lora_bias", {}).get(adapter, False):
            return False
        if not isinstance(self.lora_dropout[adapter], torch.nn.Identity):
            return False
        base = self.get_base_layer()
        if type(base) is not torch.nn.Linear or hasattr(base.weight, "ds_id"):  # ds_id: a ZeRO-3 partition
            return False
        frozen = [base.weight, base.bias] if base.bias is not None else [base.weight]
        if any(p.requires_grad for p in frozen) or torch.is_autocast_enabled(x.device.type):
            return False
        tensors = [x, *frozen, self.lora_A[adapter].weight, self.lora_B[adapter].weight]
        return all(t.dtype == x.dtype and t.device == x.device for t in tensors) and x.dtype.is_floating_point
