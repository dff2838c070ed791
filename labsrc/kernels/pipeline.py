"""Greedy verification, the last pipeline stage's step: argmax of each target row, compare, count.

After the last stage has computed the target's logits for a window of ``N`` tokens ``w_0 .. w_{N-1}``
(positions ``pos .. pos + N - 1``), speculative decoding with greedy acceptance needs three things:

* ``preds[i] = argmax(logits[i])``: the target's own next token after ``w_i``;
* the comparison of each window token with what the target wanted there: ``w_0`` with ``first`` (the
  prediction the stage kept from the window before) and ``w_i`` with ``preds[i - 1]``;
* ``accepted``: how many leading window tokens match. The correction (or, when all ``N`` match, the
  prediction for the next position) is then ``first`` if ``accepted == 0`` else ``preds[accepted - 1]``.

:func:`greedy_verify` does all three in one Triton kernel, one program per window (a row ``b`` of a batch
of windows); :func:`greedy_verify_ref` is the plain PyTorch reference. Shapes: ``logits (B, N, V)``,
``tokens (B, N)`` and ``first (B,)`` (int32 or int64); returns ``preds (B, N)`` and ``accepted (B,)``, both
int64. Ties go to the first maximal index, and a row holding a NaN predicts its first NaN, exactly as
``torch.argmax`` does; a row of ``-inf`` predicts token 0.
"""
from __future__ import annotations

import torch

from labsrc import runtime
from labsrc.kernels._triton import HAS_TRITON, tl, triton

__all__ = ["greedy_verify", "greedy_verify_ref"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_WINDOW = 1024          # rows of one window held in one tile (a draft window is k + 1 <= a few dozen)
MAX_BATCH = 2 ** 31 - 1    # grid axis 0
MAX_VOCAB = 2 ** 31 - 2    # column indices (and the sentinel V) are int32
# Elements of one (BLOCK_N, BLOCK_V) tile: on a GPU 8K fp32 values keep the tile in registers; the
# interpreter runs one program at a time in NumPy, where fewer, larger tiles are faster.
_TILE_GPU = 8192
_TILE_INTERPRETER = 2 ** 18


@triton.jit
def _greedy_verify_kernel(logits, tokens, first, preds, accepted, N, V,
                          BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # this window's (N, V) block, int64 offsets
    base = logits + b * N * V
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK_N,), V, tl.int32)         # V: "nothing found yet"
    nan_idx = tl.full((BLOCK_N,), V, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < V)[None, :]
        x = tl.load(base + rows[:, None].to(tl.int64) * V + cols[None, :], mask=ok,
                    other=float("-inf")).to(tl.float32)
        is_nan = x != x
        nan_idx = tl.minimum(
            nan_idx, tl.min(tl.where(is_nan & ok, cols[None, :], V), axis=1)
        )
        x = tl.where(is_nan, float("-inf"), x)
        block_max = tl.max(x, axis=1)
        # first column of this block that reaches the block's max (masked lanes hold
        # -inf and lie past V, so they only win a row of -inf when no real column is
        # left, which min() rules out)
        block_idx = tl.min(
            tl.where((x == block_max[:, None]) & ok, cols[None, :], V), axis=1
        )
        # strictly greater: an earlier block keeps a tie
        take = (block_max > best) | (best_idx == V)
        best_idx = tl.where(take, block_idx, best_idx)
        best = tl.where(take, block_max, best)
    pred = tl.where(nan_idx < V, nan_idx, best_idx).to(tl.int64)
    tl.store(preds + b * N + rows, pred, mask=row_ok)
    # window token i + 1 must equal pred[i]; token 0 must equal `first`
    nxt = tl.load(tokens + b * N + rows + 1, mask=rows + 1 < N, other=-1).to(tl.int64)
    miss = (rows + 1 < N) & (nxt != pred)
    # matches among tokens 1 .. N-1 before a miss
    run = tl.min(tl.where(miss, rows, N - 1), axis=0)
    tok0 = tl.load(tokens + b * N).to(tl.int64)
    f = tl.load(first + b).to(tl.int64)
    tl.store(accepted + b, tl.where(tok0 == f, run + 1, 0).to(tl.int64))


def _check(logits, tokens, first) -> None:
    """What :func:`greedy_verify` and :func:`greedy_verify_ref` both require."""
    for name, t in (("logits", logits), ("tokens", tokens), ("first", first)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D (batch, window, vocab), got shape {tuple(logits.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES and logits.dtype != torch.float64:
        raise TypeError(f"logits has dtype {logits.dtype}; supported: float32, float16, bfloat16")
    B, N, V = logits.shape
    if N < 1 or V < 1:
        raise ValueError(f"logits needs a window of at least 1 row and a vocab of at least 1, got {(B, N, V)}")
    if tokens.dtype not in INDEX_DTYPES:
        raise TypeError(f"tokens must be int32 or int64, got {tokens.dtype}")
    if tokens.shape != (B, N):
        raise ValueError(f"tokens must have shape {(B, N)} (one token per logits row), got {tuple(tokens.shape)}")
    if first.dtype not in INDEX_DTYPES:
        raise TypeError(f"first must be int32 or int64, got {first.dtype}")
    if first.shape != (B,):
        raise ValueError(f"first must have shape {(B,)} (one expected token per window), got "
                         f"{tuple(first.shape)}")
    for name, t in (("tokens", tokens), ("first", first)):
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits is on {logits.device}; use one device")
    if logits.requires_grad and torch.is_grad_enabled():
        raise ValueError("logits requires grad: greedy_verify is an inference kernel with no backward; "
                         "call it under torch.no_grad() or pass logits.detach()")


def greedy_verify_ref(logits: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor):
    """The PyTorch reference: ``preds = logits.argmax(-1)``; ``accepted`` = leading matches of ``tokens``
    against ``[first, preds[:, :-1]]``. Takes float64 too and any layout and device."""
    _check(logits, tokens, first)
    preds = logits.argmax(-1)
    expected = torch.cat([first.long()[:, None], preds[:, :-1]], dim=1)
    match = tokens.long() == expected
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return preds, accepted


def greedy_verify(logits: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor):
    """Greedy verification of ``B`` windows in one launch (one program per window).

    Args:
        logits: ``(B, N, V)`` float32/float16/bfloat16, the target's logits for the window tokens; any
            strides (packed to a dense layout first). ``N`` at most 1024.
        tokens: ``(B, N)`` int32/int64, the window's tokens (token 0 is checked against ``first``).
        first: ``(B,)`` int32/int64, the token the target predicted for each window's first position.

    Returns ``(preds, accepted)``: ``(B, N)`` and ``(B,)`` int64. NaN and ties as ``torch.argmax``.
    Raises ``TypeError``/``ValueError`` naming the argument for a wrong type, dtype, shape or device, a
    window over 1024 rows, a vocab of 2^31 - 1 or more, or logits that require grad.
    """
    _check(logits, tokens, first)
    if logits.dtype == torch.float64:
        raise TypeError("logits has dtype torch.float64; the kernel takes float32, float16 or bfloat16 "
                        "(greedy_verify_ref takes float64)")
    B, N, V = logits.shape
    if N > MAX_WINDOW:
        raise ValueError(f"logits has a window of {N} rows; the kernel holds at most {MAX_WINDOW} rows in "
                         f"one tile (verify longer windows in pieces)")
    if V > MAX_VOCAB:
        raise ValueError(f"logits has a vocab of {V}; the kernel's int32 column indices allow at most "
                         f"{MAX_VOCAB}")
    if B > MAX_BATCH:
        raise ValueError(f"logits has a batch of {B} windows; one launch takes at most {MAX_BATCH}")
    if HAS_TRITON and logits.device.type != "cuda" and not runtime.INTERPRETED:
        raise ValueError(f"logits is on {logits.device}; compiled Triton kernels need CUDA tensors "
                         "(or run with TRITON_INTERPRET=1)")
    # The kernel reads row (b, i) at (b * N + i) * V and token (b, i) at b * N + i: dense layouts.
    logits, tokens, first = logits.contiguous(), tokens.contiguous(), first.contiguous()
    if not HAS_TRITON:   # no Triton on this machine (Linux wheels only): the reference computes it
        return greedy_verify_ref(logits, tokens, first)
    # -1 is never a valid answer: an element the kernel failed to write cannot pass for a result
    preds = torch.full((B, N), -1, dtype=torch.int64, device=logits.device)
    accepted = torch.full((B,), -1, dtype=torch.int64, device=logits.device)
    if B == 0:
        return preds, accepted
    block_n = triton.next_power_of_2(N)
    tile = _TILE_INTERPRETER if runtime.INTERPRETED else _TILE_GPU
    block_v = max(16, min(triton.next_power_of_2(V), tile // block_n))
    _greedy_verify_kernel[(B,)](logits, tokens, first, preds, accepted, N, V, BLOCK_N=block_n, BLOCK_V=block_v)
    return preds, accepted
