"""The lab's Triton ``ssd`` kernel as the scan of ``transformers``' Mamba-2 (``Mamba2ForCausalLM``).

transformers 5 routes Mamba-2's two scans through a kernel registry: in ``modeling_mamba2`` the functions
``mamba2_chunk_scan`` (prefill: the chunked SSD) and ``mamba2_selective_state_update`` (decode: one step of the
recurrence) are wrapped by ``use_kernel_func_from_hub_with_fallback``, which picks a hub kernel (the ``kernels``
package, on request), else the ``mamba_ssm`` package, else the PyTorch code; ``Mamba2Mixer.forward`` calls
them by those module-level names. On a machine with neither package (this lab's), the PyTorch code runs.
:func:`register` puts the lab's kernels in that slot, as chapter 3's ``labsrc.flash_attention`` registered
``"lab_triton"`` with ``transformers.AttentionInterface``::

    import labsrc.ssm_hf
    labsrc.ssm_hf.register()            # every Mamba2Mixer now scans with labsrc.kernels.ssm.ssd
    ...
    labsrc.ssm_hf.unregister()          # back to what transformers chose
    with labsrc.ssm_hf.lab_ssd():       # or only inside a block
        model.generate(...)

Mamba-2 has no ``AttentionInterface``-style name to select per model, so registration is process-wide: it
rebinds the two module-level names (the originals are kept and restored by :func:`unregister`).

What runs where: a prompt or chunk (``seq_len > 1``) goes to :func:`labsrc.kernels.ssm.ssd` (``dt_bias``,
softplus and ``dt_limit`` applied first, exactly as transformers does, then the kernel; its chunk is the
model's ``chunk_size`` when that is a power of two from 16 to 64, else 64: the result does not depend on it);
one decode step goes to the same kernel with ``l = 1`` and the cached state as ``initial_state``, written
back into the cache in place. The kernels are inference-only: a call that records a graph (training) falls
back to transformers' PyTorch function, so fine-tuning still works. Packed sequences (``seq_idx``,
``cu_seqlens``) are refused with ``ValueError``: the kernel does not reset its state between sequences.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

import labsrc  # noqa: F401  (interpreter switch before triton loads)
from labsrc.kernels import ssm as kssm

__all__ = ["register", "unregister", "is_registered", "lab_ssd", "lab_mamba2_chunk_scan",
           "lab_mamba2_state_update"]


class _PyTorchFallbackNote(logging.Filter):
    """Drop transformers' note that a Mamba scan "is falling back to its reference PyTorch implementation".

    transformers logs it once per function when ``mamba_ssm``/``causal_conv1d`` (CUDA-only packages) are not
    installed. For this lab that fallback is the intended reference, and the lab's own kernels are what
    :func:`register` swaps in; the note would otherwise print on chapter 7's page. Other records pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "is falling back to its reference PyTorch implementation" not in record.getMessage()


logging.getLogger("transformers.integrations.hub_kernels").addFilter(_PyTorchFallbackNote())

_ORIGINALS: dict[str, object] = {}


def _module():
    from transformers.models.mamba2 import modeling_mamba2
    return modeling_mamba2


def _records_graph(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _refuse_packed(kwargs) -> None:
    for name in ("seq_idx", "cu_seqlens"):
        if kwargs.get(name) is not None:
            raise ValueError(f"the lab's ssd kernel cannot keep packed sequences apart ({name} was given); "
                             "run one sequence per row, or unregister() to use transformers' path")


def _kernel_chunk(chunk_size: int) -> int:
    """The kernel's chunk: the model's when it is a power of two from 16 to 64, else 64. The result does not
    depend on it; a chunk of 64 keeps the kernel's (Q, Q) and (Q, n) tiles in registers on a GPU, where
    Mamba-2's usual 256 would spill."""
    ok = isinstance(chunk_size, int) and kssm.MIN_CHUNK <= chunk_size <= 64
    return chunk_size if ok and not chunk_size & (chunk_size - 1) else 64


def _prepare_dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def lab_mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """Drop-in for ``modeling_mamba2.mamba2_chunk_scan`` on :func:`labsrc.kernels.ssm.ssd`.

    Same arguments and returns: ``hidden_states (b, l, h, p)``, raw ``dt (b, l, h)`` with ``dt_bias`` and
    ``dt_softplus`` applied here, ``A (h,)``, ``B, C (b, l, g, n)``; returns ``y (b, l, h, p)`` float32 (as
    transformers' does) and, with ``return_final_states``, the final state ``(b, h, p, n)`` float32.
    """
    _refuse_packed(kwargs)
    if _records_graph(hidden_states, dt, A, B, C, D, dt_bias, initial_states):
        return _ORIGINALS.get("mamba2_chunk_scan", _module().mamba2_chunk_scan)(
            hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
            dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states, **kwargs)
    dt = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    y, final = kssm.ssd(hidden_states, dt, A, B, C, D, initial_states, chunk_size=_kernel_chunk(chunk_size))
    y = y.float()
    return (y, final) if return_final_states else y


def lab_mamba2_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None,
                            **kwargs):
    """Drop-in for ``modeling_mamba2.mamba2_selective_state_update``: one decode step on the ``ssd`` kernel.

    transformers passes the per-head values expanded over the head dimension (``dt (b, h, p)``,
    ``A (h, p, n)``, ``D`` and ``dt_bias (h, p)``); the kernel takes them per head. ``state (b, h, p, n)`` is
    updated in place; returns ``y (b, h, p)`` in ``hidden_states``' dtype.
    """
    _refuse_packed(kwargs)
    if _records_graph(hidden_states, dt, A, B, C, D, dt_bias, z):
        return _ORIGINALS.get("mamba2_selective_state_update", _module().mamba2_selective_state_update)(
            state, hidden_states, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z, **kwargs)
    per_head = lambda t: None if t is None else (t[..., 0] if t.dim() >= 2 else t)  # noqa: E731
    dt_h = dt[..., 0] if dt.dim() == 3 else dt                       # (b, h)
    A_h = A[:, 0, 0] if A.dim() == 3 else A                          # (h,)
    D_h, bias_h = per_head(D), per_head(dt_bias)
    dt_h = _prepare_dt(dt_h, bias_h, dt_softplus, (0.0, float("inf")))
    b, g = B.shape[0], B.shape[1]
    y, new_state = kssm.ssd(hidden_states[:, None], dt_h[:, None], A_h, B.reshape(b, 1, g, -1),
                            C.reshape(b, 1, g, -1), D_h, state, chunk_size=kssm.MIN_CHUNK)
    state.copy_(new_state.to(state.dtype))
    y = y[:, 0]
    if z is not None:
        y = y * F.silu(z)
    return y.to(hidden_states.dtype)


def register() -> None:
    """Route every Mamba-2 mixer's scans to the lab's ``ssd`` kernel (idempotent)."""
    mod = _module()
    if is_registered():
        return
    _ORIGINALS["mamba2_chunk_scan"] = mod.mamba2_chunk_scan
    _ORIGINALS["mamba2_selective_state_update"] = mod.mamba2_selective_state_update
    mod.mamba2_chunk_scan = lab_mamba2_chunk_scan
    mod.mamba2_selective_state_update = lab_mamba2_state_update


def unregister() -> None:
    """Give the scans back to what transformers chose (its PyTorch code on this machine)."""
    mod = _module()
    if not is_registered():
        return
    mod.mamba2_chunk_scan = _ORIGINALS.pop("mamba2_chunk_scan")
    mod.mamba2_selective_state_update = _ORIGINALS.pop("mamba2_selective_state_update")


def is_registered() -> bool:
    """Whether the lab's kernel is in the slot now."""
    return _module().mamba2_chunk_scan is lab_mamba2_chunk_scan


@contextlib.contextmanager
def lab_ssd():
    """Use the lab's ``ssd`` kernel inside a ``with`` block; restores the previous routing after it."""
    was = is_registered()
    register()
    try:
        yield
    finally:
        if not was:
            unregister()
