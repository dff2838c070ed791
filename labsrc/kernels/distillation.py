"""A fused distillation loss in Triton: the per-token KL between temperature softmaxes, and its gradient,
without materialising a probability.

:func:`kd_kl` computes, for each row of ``student_logits`` and ``teacher_logits`` (``(..., V)``)::

    KL_row = KL(softmax(teacher / T) || softmax(student / T))

the soft term of :func:`labsrc.distillation.kd_loss` before its ``T²`` weight and its mean over tokens (the
reference :func:`kd_kl_ref` computes what :func:`labsrc.distillation.soft_kl` does, and the tests hold them equal;
it is written out here because the mechanism module imports this one for ``kd_loss(..., fused=True)``, and a
kernel module never imports back from the module that uses it). Written in the scaled logits
``a = teacher / T`` and ``b = student / T``, with ``p = softmax(a)``::

    KL = sum_v p_v (a_v - b_v) - logsumexp(a) + logsumexp(b)

so one pass over the vocabulary suffices: each program owns one row, walks it in ``BLOCK_V`` chunks and keeps
five fp32 scalars, the running maxima and rescaled sums of both softmaxes and the running ``sum e^(a - m)(a -
b)`` (rescaled with the teacher's maximum, as an online softmax rescales its sum). The PyTorch way reads both
rows, writes two ``(rows, V)`` log-probability tensors and reads them again; at a 128k vocabulary and 8k
tokens that is 4 GB of fp32 per tensor, which is why Liger-Kernel and others fuse this loss. The forward saves
the two log-sum-exps (8 bytes per row); the backward is a second pass that writes the student's gradient::

    d KL / d student_v = (softmax(b)_v - p_v) / T

and nothing for the teacher (a teacher that requires grad is refused: detach it). :func:`kd_kl` runs the
backward through ``torch.autograd`` whenever the student requires grad, so it trains a student.

Non-finite input, as in the reference: a vocabulary entry whose teacher logit is ``-inf`` has ``p = 0`` and
contributes nothing (a padded vocabulary); a row whose teacher logits are all ``-inf`` has KL 0 and gradient 0;
a student ``-inf`` where the teacher has mass gives ``+inf`` (or NaN for a student row with no finite logit);
NaN propagates. Inputs are fp32, fp16 or bf16 (both the same dtype); arithmetic is fp32; the KL is fp32 and the
gradient has the student's dtype. No ``tl.dot``: bf16 runs natively under the interpreter.
"""
from __future__ import annotations

import math
import numbers

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["kd_kl", "kd_kl_ref", "kd_kl_backward_ref", "check_kd_kl_inputs"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_GRID_AXIS_0 = 2 ** 31 - 1
_MAX_V = 2 ** 31 - 1  # column offsets are int32 inside a row


def check_kd_kl_inputs(student_logits, teacher_logits, T, allow_float64: bool = False):
    """The checks shared by :func:`kd_kl` and :func:`kd_kl_ref` (the reference also takes float64)."""
    dtypes = _DTYPES + ((torch.float64,) if allow_float64 else ())
    for name, x in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in dtypes:
            raise TypeError(f"{name} must be one of {', '.join(str(d) for d in dtypes)}, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] < 1:
            raise ValueError(f"{name} must be (..., V) with V >= 1, got shape {tuple(x.shape)}")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits must have the shape of student_logits {tuple(student_logits.shape)}, "
                         f"got {tuple(teacher_logits.shape)}")
    if teacher_logits.dtype != student_logits.dtype:
        raise TypeError(f"teacher_logits must have the dtype of student_logits ({student_logits.dtype}), "
                        f"got {teacher_logits.dtype}")
    if teacher_logits.device != student_logits.device:
        raise ValueError(f"teacher_logits is on {teacher_logits.device} but student_logits on "
                         f"{student_logits.device}; put both on one device")
    if torch.is_grad_enabled() and teacher_logits.requires_grad:
        raise ValueError("teacher_logits must not require grad: the backward gives the student's gradient "
                         "only; pass teacher_logits.detach()")
    if isinstance(T, bool) or not isinstance(T, numbers.Real) or not math.isfinite(T) or T <= 0:
        raise ValueError(f"T must be a positive finite number, got {T!r}")
    if not 1e-30 < 1.0 / float(T) < 1e30:
        raise ValueError(f"T = {T!r} makes 1/T overflow or underflow float32")


def kd_kl_ref(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """Per-row ``KL(softmax(teacher/T) || softmax(student/T))`` in PyTorch, the soft term of ``kd_loss``
    before its ``T²`` and its mean (float32; float64 in, float64 out). The same arithmetic as
    :func:`labsrc.distillation.soft_kl` (tests/test_distillation.py holds them equal bit for bit)."""
    check_kd_kl_inputs(student_logits, teacher_logits, T, allow_float64=True)
    work = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    log_q = torch.log_softmax(student_logits.to(work) / T, dim=-1)
    log_p = torch.log_softmax(teacher_logits.to(work) / T, dim=-1)
    return _kl_rows(log_p, log_q)


def _kl_rows(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``sum_v a_v (log a_v - log b_v)`` with ``0 log 0 = 0``: an entry where ``a = 0`` (a teacher logit of
    ``-inf``) adds nothing, and its gradient is 0 rather than the ``0 * inf = NaN`` a plain product gives."""
    a = log_a.exp()
    has_mass = a > 0
    diff = torch.where(has_mass, log_a - log_b, torch.zeros_like(a))
    return (torch.where(has_mass, a, torch.zeros_like(a)) * diff).sum(-1)


def kd_kl_backward_ref(grad_kl: torch.Tensor, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       T: float = 1.0) -> torch.Tensor:
    """The student's gradient ``grad_kl[..., None] * (softmax(b) - softmax(a)) / T`` (0 for a teacher row
    with no finite logit), in the student's dtype."""
    check_kd_kl_inputs(student_logits, teacher_logits, T, allow_float64=True)
    work = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    q = torch.softmax(student_logits.to(work) / T, dim=-1)
    p = torch.softmax(teacher_logits.to(work) / T, dim=-1)
    dead = torch.isneginf(teacher_logits).all(-1, keepdim=True)
    p = torch.where(dead, torch.zeros_like(p), p)
    g = torch.where(dead, torch.zeros_like(q), grad_kl.to(work)[..., None] * (q - p) / T)
    return g.to(student_logits.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Autotuning: one configuration under the interpreter, a few block widths and warp counts on a GPU.
# ----------------------------------------------------------------------------------------------------------------
def _configs() -> list:
    if runtime.INTERPRETED:
        # The interpreter runs programs one after another in NumPy: a wide block means fewer loop steps.
        # 1024 still leaves several blocks at the test vocabularies (1000-5000), exercising the rescaling.
        return [triton.Config({"BLOCK_V": 1024}, num_warps=4, num_stages=1)]
    # A row is a stream: wider blocks keep more loads in flight, more warps split them across the SM.
    return [triton.Config({"BLOCK_V": v}, num_warps=w, num_stages=s)
            for v in (1024, 2048, 4096) for w in (4, 8, 16) for s in (2, 3)]


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.autotune(configs=_configs(), key=["V_BUCKET"])
@triton.jit
def _kd_kl_fwd_kernel(s_ptr, t_ptr, kl_ptr, lse_s_ptr, lse_t_ptr,
                      V, stride_s, stride_t, inv_T,
                      V_BUCKET, BLOCK_V: tl.constexpr):
    # int64: row * stride may pass 2^31 at a large batch x vocabulary
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    # Five fp32 scalars live in registers for the whole row: the running maxima
    # (m_t, m_s), the rescaled sums of exponentials (z_t, z_s) and
    # acc = sum_v exp(a_v - m_t) * (a_v - b_v).
    m_t = tl.full((), float("-inf"), tl.float32)
    m_s = tl.full((), float("-inf"), tl.float32)
    z_t = tl.zeros((), tl.float32)
    z_s = tl.zeros((), tl.float32)
    acc = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        # Padded lanes read -inf: exp(-inf) = 0, so they add nothing to any sum.
        a = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_T
        b = tl.load(s_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_T
        # Teacher: new maximum, rescale what was summed so far, add this block. A
        # maximum of -inf (all -inf so far) is replaced by 0 in the exponents, so
        # that -inf - (-inf) never makes a NaN.
        new_t = tl.maximum(m_t, tl.max(a, 0))
        safe_t = tl.where(new_t == float("-inf"), 0.0, new_t)
        scale_t = tl.exp(m_t - safe_t)
        e = tl.exp(a - safe_t)
        # a - b, never evaluating -inf - (-inf) (NumPy, under the interpreter, would
        # warn): +inf where the student has -inf and the teacher mass; 0 where the
        # teacher has no mass (0 log 0 = 0)
        a_f = tl.where(a == float("-inf"), 0.0, a)
        b_f = tl.where(b == float("-inf"), 0.0, b)
        d = tl.where(b == float("-inf"), float("inf"), a_f - b_f)
        d = tl.where(e > 0, d, 0.0)
        acc = acc * scale_t + tl.sum(e * d, 0)
        z_t = z_t * scale_t + tl.sum(e, 0)
        m_t = new_t
        # Student: only its log-sum-exp is needed.
        new_s = tl.maximum(m_s, tl.max(b, 0))
        safe_s = tl.where(new_s == float("-inf"), 0.0, new_s)
        z_s = z_s * tl.exp(m_s - safe_s) + tl.sum(tl.exp(b - safe_s), 0)
        m_s = new_s
    # A sum of 0 means no finite logit in the row: log-sum-exp -inf. A dead teacher
    # row has KL 0; a dead student row under a live teacher has KL NaN, as in the
    # reference (its softmax is 0/0).
    zt_safe = tl.where(z_t > 0, z_t, 1.0)
    zs_safe = tl.where(z_s > 0, z_s, 1.0)
    lse_t = tl.where(z_t > 0, m_t + tl.log(zt_safe), float("-inf"))
    lse_s = tl.where(z_s > 0, m_s + tl.log(zs_safe), float("-inf"))
    kl = acc / zt_safe - tl.where(z_t > 0, lse_t, 0.0) + tl.where(z_s > 0, lse_s, 0.0)
    kl = tl.where(z_s > 0, kl, float("nan"))
    kl = tl.where(z_t > 0, kl, 0.0)
    tl.store(kl_ptr + row, kl)
    tl.store(lse_t_ptr + row, lse_t)
    tl.store(lse_s_ptr + row, lse_s)


@triton.autotune(configs=_configs(), key=["V_BUCKET"])
@triton.jit
def _kd_kl_bwd_kernel(s_ptr, t_ptr, lse_s_ptr, lse_t_ptr, g_ptr, ds_ptr,
                      V, stride_s, stride_t, stride_ds, inv_T,
                      V_BUCKET, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse_t = tl.load(lse_t_ptr + row)
    lse_s = tl.load(lse_s_ptr + row)
    # d KL / d s_v = g * (q_v - p_v) / T; a teacher row with no finite logit has
    # KL 0 and gradient 0.
    dead = lse_t == float("-inf")
    g = tl.load(g_ptr + row) * inv_T
    safe_lse_t = tl.where(dead, 0.0, lse_t)
    # the softmax of a row with no finite logit is NaN, as in the reference
    no_student = lse_s == float("-inf")
    safe_lse_s = tl.where(no_student, 0.0, lse_s)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        a = tl.load(t_ptr + row * stride_t + cols, mask=mask, other=float("-inf"))
        b = tl.load(s_ptr + row * stride_s + cols, mask=mask, other=float("-inf"))
        a = a.to(tl.float32) * inv_T
        b = b.to(tl.float32) * inv_T
        q = tl.where(no_student, float("nan"), tl.exp(b - safe_lse_s))
        p = tl.exp(a - safe_lse_t)
        ds = tl.where(dead, 0.0, g * (q - p))
        ds_row = ds_ptr + row * stride_ds
        tl.store(ds_row + cols, ds.to(ds_ptr.dtype.element_ty), mask=mask)


def _check_launch(student_logits):
    V = student_logits.shape[-1]
    rows = student_logits.numel() // V if V else 0
    if rows > _MAX_GRID_AXIS_0:
        raise ValueError(f"student_logits has {rows} rows but one launch handles at most {_MAX_GRID_AXIS_0} "
                         f"(one program per row on Triton's grid axis 0); split the batch")
    if V > _MAX_V:
        raise ValueError(f"student_logits has a vocabulary of {V} but the kernel's column offsets are int32 "
                         f"(at most {_MAX_V})")
    if HAS_TRITON and student_logits.device.type != "cuda" and not runtime.INTERPRETED:
        raise ValueError(f"tensors are on {student_logits.device}; compiled Triton kernels need CUDA tensors "
                         f"(without a GPU, import labsrc first so that the interpreter is used)")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a dense ``(rows, V)`` tensor: every tensor the kernel reads is contiguous (a transposed,
    sliced or expanded view is copied once)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _new(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (the tests replace this with a NaN-filled one: nothing left unwritten)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _forward(s2, t2, T):
    R, V = s2.shape
    kl, lse_s, lse_t = (_new((R,), torch.float32, s2.device) for _ in range(3))
    if R:
        _kd_kl_fwd_kernel[(R,)](s2, t2, kl, lse_s, lse_t, V, s2.stride(0), t2.stride(0), 1.0 / float(T),
                                _bucket(V))
    return kl, lse_s, lse_t


def _backward(grad, s2, t2, lse_s, lse_t, T):
    R, V = s2.shape
    ds = _new((R, V), s2.dtype, s2.device)
    grad = grad.to(torch.float32).contiguous()
    if R:
        _kd_kl_bwd_kernel[(R,)](s2, t2, lse_s, lse_t, grad, ds, V, s2.stride(0), t2.stride(0), ds.stride(0),
                                1.0 / float(T), _bucket(V))
    return ds


class _KdKlFunction(torch.autograd.Function):
    """Autograd glue: the forward saves the inputs (the dense copies the kernel read) and the two fp32
    log-sum-exps per row; the backward kernel recomputes both softmaxes from them, block by block."""

    @staticmethod
    def forward(ctx, s2, t2, T):
        kl, lse_s, lse_t = _forward(s2, t2, T)
        ctx.save_for_backward(s2, t2, lse_s, lse_t)
        ctx.T = T
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        s2, t2, lse_s, lse_t = ctx.saved_tensors
        return _backward(grad, s2, t2, lse_s, lse_t, ctx.T), None, None


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """Per-row ``KL(softmax(teacher/T) || softmax(student/T))`` (Triton, one pass over the vocabulary).

    Args:
        student_logits, teacher_logits: ``(..., V)``, the same shape, dtype (fp32/fp16/bf16) and device; any
            strides (a view the kernel cannot address row by row is copied). ``teacher_logits`` must not
            require grad.
        T: the temperature, a positive finite number.

    Returns:
        fp32 ``(...)``, equal to :func:`kd_kl_ref`. Differentiable with respect to ``student_logits`` (a
        Triton backward; the gradient has the student's dtype).

    Raises ``TypeError`` for wrong types or dtypes and ``ValueError`` for wrong shapes, devices, a bad
    ``T``, a teacher that requires grad, or sizes Triton cannot launch (over 2^31 - 1 rows or vocabulary
    entries), naming the argument.
    """
    check_kd_kl_inputs(student_logits, teacher_logits, T)
    _check_launch(student_logits)
    lead = student_logits.shape[:-1]
    if not HAS_TRITON:  # no Triton on this machine (it has Linux wheels only): the reference computes it
        return kd_kl_ref(student_logits, teacher_logits, T)
    s2, t2 = _rows(student_logits), _rows(teacher_logits.detach())
    if torch.is_grad_enabled() and student_logits.requires_grad:
        return _KdKlFunction.apply(s2, t2, float(T)).reshape(lead)
    return _forward(s2, t2, float(T))[0].reshape(lead)
