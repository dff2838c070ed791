"""Quantizing a whole model: its linear layers, calibration inputs, the quantized layer modules (AWQ, INT8
with outliers, MXFP4 through torchao), QAT, and what a quantized model is measured by (bytes, loss, outliers).
"""
from __future__ import annotations

import copy

import torch

from labsrc.weight_quant.awq import apply_awq, awq_search_scales
from labsrc.weight_quant.gptq import gptq_quantize, hessian
from labsrc.kernels.weight_quant.mxfp4 import fake_quant_mxfp4, mxfp4_dequantize, mxfp4_quantize
from labsrc.weight_quant.outliers import int8_matmul_outlier
from labsrc.kernels.weight_quant.rtn import dequantize, quantize_rtn


# ----------------------------------------------------------------------------------------------- a model
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_layers(model) -> list[tuple[str, torch.nn.Linear]]:
    """The decoder's linear layers ``(name, module)`` in forward order (the embedding and the output head
    stay in full precision, as GPTQ and AWQ leave them)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for name in LINEAR_NAMES:
            part = layer.self_attn if name in LINEAR_NAMES[:4] else layer.mlp
            out.append((f"layers.{i}.{name}", getattr(part, name)))
    return out


def calibration_ids(tokenizer, n_windows: int, length: int, split: str = "train", seed: int = 0) -> torch.Tensor:
    """``(n_windows, length)`` token windows from the lab corpus (BOS first), drawn at seeded offsets."""
    from labsrc.tasks import corpus_ids

    ids = corpus_ids(tokenizer, split)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n_windows,), generator=gen)
    bos = torch.tensor([tokenizer.bos_token_id])
    return torch.stack([torch.cat([bos, ids[s:s + length - 1]]) for s in starts.tolist()])


@torch.no_grad()
def collect_linear_inputs(model, input_ids: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
    """The inputs ``(tokens, K)`` each named linear layer sees when ``model`` reads ``input_ids``."""
    layers = dict(linear_layers(model))
    names = list(layers) if names is None else list(names)
    seen, hooks = {}, []
    for name in names:
        hooks.append(layers[name].register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, args[0].detach().reshape(-1, args[0].shape[-1]))))
    try:
        model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


class AWQLinear(torch.nn.Module):
    """A linear layer with AWQ's input scaling kept explicit: ``(x / s) @ W_hat^T``."""

    def __init__(self, w_hat: torch.Tensor, s: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(w_hat, requires_grad=False)
        self.register_buffer("inv_s", 1.0 / s)

    def forward(self, x):
        return torch.nn.functional.linear(x * self.inv_s.to(x.dtype), self.weight)


def _set_module(model, name: str, module) -> None:
    _, i, last = name.split(".")
    layer = model.model.layers[int(i)]
    setattr(layer.self_attn if last in LINEAR_NAMES[:4] else layer.mlp, last, module)


@torch.no_grad()
def quantize_model(model, method: str, calib_ids: torch.Tensor | None = None, bits: int = 4,
                   group_size: int | None = 128, symmetric: bool = True, **kw):
    """A copy of ``model`` whose decoder linears hold the dequantized weights of ``method``, and the weight bytes.

    ``method``: ``"rtn"``, ``"gptq"``, ``"awq"`` (both calibrated on ``calib_ids``, layer by layer: the
    inputs of layer ``i`` come from the model whose layers before ``i`` are already quantized) or
    ``"mxfp4"``. Returns ``(model_copy, bytes of the decoder linears as stored)``. The copy computes with
    dequantized fp32 weights: the same numbers the Triton GEMMs produce from the packed ones.
    """
    if method not in ("rtn", "gptq", "awq", "mxfp4"):
        raise ValueError(f"method must be 'rtn', 'gptq', 'awq' or 'mxfp4', got {method!r}")
    if method in ("gptq", "awq") and calib_ids is None:
        raise ValueError(f"{method} needs calib_ids")
    q = copy.deepcopy(model)
    total = 0
    names = [n for n, _ in linear_layers(q)]
    for i in range(len(q.model.layers)):
        layer_names = [n for n in names if n.startswith(f"layers.{i}.")]
        inputs = collect_linear_inputs(q, calib_ids, layer_names) if method in ("gptq", "awq") else {}
        mods = dict(linear_layers(q))
        for name in layer_names:
            w = mods[name].weight.float()
            if method == "mxfp4":
                codes, scales = mxfp4_quantize(w)
                mods[name].weight.copy_(mxfp4_dequantize(codes, scales))
                total += codes.numel() + scales.numel()
            elif method == "awq":
                s = awq_search_scales(w, inputs[name], bits, group_size, symmetric=symmetric, **kw)
                qw = apply_awq(w, s, bits, group_size, symmetric)
                _set_module(q, name, AWQLinear(dequantize(qw), s))
                total += qw.nbytes + 2 * s.numel()  # the fp16 scales until folded
            else:
                qw = (gptq_quantize(w, hessian(inputs[name]), bits, group_size, symmetric=symmetric, **kw)
                      if method == "gptq" else quantize_rtn(w, bits, group_size, symmetric))
                mods[name].weight.copy_(dequantize(qw))
                total += qw.nbytes
    return q, total


def model_weight_bytes(model, bytes_per_weight: float = 4.0) -> int:
    """Bytes of the decoder's linear weights stored at ``bytes_per_weight`` each (4 for fp32, 2 for fp16)."""
    return int(sum(m.weight.numel() for _, m in linear_layers(model)) * bytes_per_weight)


def torchao_mx():
    """torchao's MX functions ``(to_mx, to_dtype)``, for the tests and the chapter's comparison.

    Importing torchao on a machine without its compiled extensions logs "Failed to load ... .so" lines and
    pytree deprecation warnings; :mod:`labsrc.runtime` (imported with :mod:`labsrc`) drops exactly those two
    messages, whoever imports torchao first (transformers does, on any model load), so the page shows no stderr.
    """
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    return to_mx, to_dtype


# ----------------------------------------------------------------------------------------------- experiment
class Int8OutlierLinear(torch.nn.Module):
    """A linear layer computed by :func:`int8_matmul_outlier` (LLM.int8(): outlier features in fp32)."""

    def __init__(self, weight: torch.Tensor, threshold: float = 6.0):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.threshold = threshold

    def forward(self, x):
        return int8_matmul_outlier(x, self.weight, self.threshold).to(x.dtype)


def int8_model(model, threshold: float = 6.0):
    """A copy of ``model`` whose decoder linears run LLM.int8() (weights and activations in INT8, outlier
    features in fp32), and the weight bytes (int8 codes plus an fp16 absmax per output row)."""
    q = copy.deepcopy(model)
    total = 0
    for name, mod in linear_layers(q):
        _set_module(q, name, Int8OutlierLinear(mod.weight, threshold))
        total += mod.weight.numel() + 2 * mod.weight.shape[0]
    return q, total


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """Mean next-token loss (nats) of each window ``(n, T)``: float64 ``(n,)``."""
    out = []
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size]
        logits = model(input_ids=x).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        out.append(nll.double().mean(1))
    return torch.cat(out)


def activation_outliers(model, input_ids: torch.Tensor) -> dict[str, float]:
    """For each decoder linear, its largest input channel's max ``|x|`` over the median channel's."""
    acts = collect_linear_inputs(model, input_ids)
    out = {}
    for name, x in acts.items():
        per_channel = x.abs().amax(0)
        out[name] = float(per_channel.max() / per_channel.median().clamp_min(1e-12))
    return out


def qat_mxfp4(model, tokenizer, steps: int, lr: float = 1e-4, seq_len: int = 256, batch_size: int = 2,
              fake_quant: bool = True, seed: int = 0):
    """Fine-tune a copy of ``model`` with its decoder linears fake-quantized to MXFP4 in the forward pass
    (straight-through estimator), on the lab's training mixture (:func:`labsrc.rope_finetune.finetune`); return
    ``(copy with the trained weights quantized to MXFP4, losses, the trained full-precision copy)``.
    ``fake_quant=False`` is the control: the same steps in full precision, then MXFP4 PTQ."""
    from torch.nn.utils import parametrize

    from labsrc.rope_finetune import finetune

    class _FakeQuant(torch.nn.Module):
        def forward(self, w):
            return fake_quant_mxfp4(w)

    m = copy.deepcopy(model)
    if fake_quant:
        for _, mod in linear_layers(m):
            parametrize.register_parametrization(mod, "weight", _FakeQuant())
    losses = finetune(m, tokenizer, seq_len, steps, lr=lr, batch_size=batch_size, seed=seed)
    if fake_quant:
        for _, mod in linear_layers(m):
            parametrize.remove_parametrizations(mod, "weight", leave_parametrized=False)
    q, _ = quantize_model(m, "mxfp4")
    return q, losses, m
