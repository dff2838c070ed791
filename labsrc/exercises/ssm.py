"""Checks for the exercises of the state-space chapter (S4, Mamba's selective scan, Mamba-2's SSD).

Each check calls the student's function on seeded random inputs and compares it with :mod:`labsrc.ssm` or with
a measurement; it prints ``passed``, what is wrong (with a hint), or ``not solved yet``. Expected answers are
never printed.

* :func:`check_zoh_diagonal` -- ``fn(a, b, dt) -> (Ab, Bb)``: zero-order hold for a diagonal ``A``.
* :func:`check_mamba_cache_bytes` -- ``fn(config, batch) -> bytes``: a prediction of the cache a transformers
  Mamba-2 keeps, compared with the cache measured on small random models.
* :func:`check_chunk_state_reset` -- ``fn(S, x, a, B) -> S'``: one chunk of SSD's state passing in float32 that
  survives a gate that (nearly) resets the state: the fix of a given function that does not.
* :func:`check_scan_grad_kernel` -- a ``@triton.jit`` kernel for the gradient of the linear scan, a scan that
  runs from the end of each row (the chapter's kernel runs forward), launched under Triton's interpreter and
  compared with autograd through :func:`labsrc.ssm.linear_scan_loop`.

A check refuses an answer that calls the :mod:`labsrc.ssm` function that would do the exercise for it.
"""
from __future__ import annotations

import math
import types

import torch

from labsrc import ssm
from labsrc.exercises.core import not_a_kernel, skipped_without_triton, stub_raised
from labsrc.exercises.core import (FAILED, NOT_SOLVED, PASSED, Refused, Result, _call, _compare_tensors,
                                   _report, check_function, exercise, fail, guarded, hidden, randint, refusal,
                                   refuse_library, seed_for, trials_for)

__all__ = ["check_zoh_diagonal", "check_mamba_cache_bytes", "check_chunk_state_reset", "check_scan_grad_kernel",
           "scan_grad_reference"]


def _refuse(title, fn, forbidden, hint, args):
    return refuse_library(title, fn, forbidden, hint, owner="labsrc.ssm", args=args)


def _tensor_pair(fn):
    """Turn an answer returning two tensors into one stacked tensor (the checks compare one tensor)."""
    def wrapped(*args):
        got = fn(*args)
        if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
            if got[0].shape == got[1].shape:
                return torch.stack([torch.as_tensor(got[0]), torch.as_tensor(got[1])])
            return torch.cat([got[0].flatten(), got[1].flatten()])
        return got
    return wrapped


# ------------------------------------------------------------------------------------------- ZOH, diagonal

def _zoh_inputs(gen):
    n = randint(gen, 1, 12)
    a = -(torch.rand(n, generator=gen, dtype=torch.float64) * 4.9 + 0.1)
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    dt = float(torch.rand(1, generator=gen, dtype=torch.float64)) * 0.5 + 0.001
    return a, b, dt


def _zoh_reference(a, b, dt):
    Ab, Bb = ssm.discretize(a, b, dt, "zoh")
    return torch.stack([Ab, Bb])


@exercise
def check_zoh_diagonal(fn) -> Result:
    """Check ``fn(a, b, dt) -> (Ab, Bb)``: zero-order hold of ``x' = a x + b u`` for a diagonal ``A`` given
    as its diagonal ``a (N,)`` (float64, negative), ``b (N,)``, a step ``dt``."""
    name = "zero-order hold for a diagonal A"
    hint = ("re-read 'A continuous state space and its discretisation' and test your pair on a case you can "
            "solve by hand: one step from x = 0 with u = 1 held, and the limit of a very small dt.")
    refused = _refuse(name, fn, (ssm.discretize,), hint, _zoh_inputs(torch.Generator().manual_seed(71)))
    if refused is not None:
        return refused
    return check_function(name, _tensor_pair(fn), _zoh_reference, _zoh_inputs, trials=6, seed=71,
                          rtol=1e-9, atol=1e-12, hint=hint, forbidden=(ssm.discretize,), owner="labsrc.ssm")


# ------------------------------------------------------------------------------- the recurrent cache
def _mamba_config(gen):
    """A small random Mamba-2 configuration whose heads fill the inner width, as transformers requires."""
    from transformers import Mamba2Config

    head_dim = randint(gen, 1, 4) * 2
    num_heads = (2, 3, 4, 6)[randint(gen, 0, 3)]
    n_groups = [g for g in (1, 2, 3) if num_heads % g == 0][randint(gen, 0, 1)]
    expand = (1, 2)[randint(gen, 0, 1)]
    if (num_heads * head_dim) % expand:
        expand = 1
    return Mamba2Config(vocab_size=32, hidden_size=num_heads * head_dim // expand, expand=expand,
                        num_hidden_layers=randint(gen, 1, 3), head_dim=head_dim, num_heads=num_heads,
                        n_groups=n_groups, state_size=randint(gen, 1, 9), conv_kernel=randint(gen, 2, 5),
                        chunk_size=8)


def _measured_cache_bytes(config, batch, gen) -> int:
    """Build a float32 ``Mamba2ForCausalLM`` with random weights, prefill ``batch`` random prompts and measure
    every tensor its cache holds (:func:`labsrc.ledger.cache_bytes`, as the chapter's memory experiment does)."""
    from transformers import Mamba2ForCausalLM

    from labsrc import ledger

    torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen)))
    model = Mamba2ForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (batch, randint(gen, 1, 20)), generator=gen)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    return ledger.cache_bytes(cache)


_CACHE_FIELDS = ("num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")


@exercise
def check_mamba_cache_bytes(fn) -> Result:
    """Check ``fn(config, batch) -> bytes``: the prediction, from a transformers ``Mamba2Config`` alone, of the
    bytes of the cache a float32 ``Mamba2ForCausalLM`` keeps for ``batch`` sequences after a prefill. The
    truth is measured: the check builds small random models, prefills random prompts and counts every tensor
    their caches hold."""
    name = "the recurrent cache of a Mamba-2"
    hint = ("re-read 'Memory per generated token' and, for one layer of the Mamba-2 block, list what a decode step "
            "needs from the past: the SSM state and the window of the short convolution (over which channels?).")
    # The answer gets the configuration's fields, not a transformers object, and runs with transformers, the
    # lab's SSM code and its cache counter refused: building the model and measuring its cache is the bypass.
    import transformers

    from labsrc import ledger

    answer = guarded(fn, (transformers, ssm, ledger))
    trials = trials_for(4)
    gen = torch.Generator().manual_seed(seed_for(75))
    for trial in range(trials):
        config, batch = _mamba_config(gen), randint(gen, 1, 3)
        fields = types.SimpleNamespace(**config.to_dict())
        try:
            got, unsolved = _call(answer, fields, batch)
        except Refused as refused:
            return refusal(name, refused.names, hint)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        shape = ", ".join(f"{f} {getattr(config, f)}" for f in _CACHE_FIELDS)
        case = f"trial {trial + 1} of {trials}, {shape}, expand {config.expand}, {batch} sequence(s)"
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return fail(name, case, f"expected a number of bytes, got {type(got).__name__}.", hint)
        measured = _measured_cache_bytes(config, batch, gen)
        if not math.isclose(got, measured, rel_tol=1e-9):
            return fail(name, case, "the bytes returned are not the bytes the cache of this model holds.", hint)
    return _report(Result(name, PASSED, f"equal to the measured cache of {trials} random Mamba-2 models."))


# ----------------------------------------------------------------------- the chunk state, after a reset

def _reset_inputs(gen, kind):
    """One chunk in float32: ``S (p, n)``, ``x (Q, p)`` (already scaled by its step), log-decays ``a (Q,)``,
    ``B (Q, n)``. ``kind``: "small" gates only, a "near reset" (one very negative log-decay, small ones after
    it), or a "hard reset" (one log-decay of -inf, a decay of exactly zero)."""
    q, p, n = randint(gen, 6, 24), randint(gen, 1, 6), randint(gen, 1, 8)
    S = torch.randn(p, n, generator=gen)
    x = torch.randn(q, p, generator=gen)
    B = torch.randn(q, n, generator=gen)
    if kind == "small":
        a = -torch.rand(q, generator=gen) * 0.5
    else:
        a = -torch.rand(q, generator=gen) * 2e-3 - 1e-4
        at = randint(gen, 1, q - 3)
        a[at] = -float("inf") if kind == "hard reset" else -(1e4 + float(torch.rand(1, generator=gen)) * 4e4)
    return S, x, a, B


def _reset_reference(S, x, a, B):
    """The recurrence itself, one step at a time in float64: ``S <- exp(a_t) S + x_t B_t^T``."""
    state = S.double()
    for t in range(a.shape[0]):
        state = torch.exp(a[t].double()) * state + torch.outer(x[t].double(), B[t].double())
    return state.float()


@exercise
def check_chunk_state_reset(fn) -> Result:
    """Check ``fn(S, x, a, B) -> S_next`` in float32 for one head and one chunk: ``S (p, n)`` the state the chunk
    starts from, ``x (Q, p)`` the inputs already scaled by their steps, ``a (Q,)`` the log-decays (``<= 0``,
    possibly ``-inf``), ``B (Q, n)``; the state after the chunk without a loop over its steps. Compared with the
    step-by-step recurrence in float64, on chunks with small gates, a near reset and a hard reset."""
    name = "the chunk state after a reset"
    hint = ("run the recurrence one step at a time on the failing chunk and compare, position by position, how "
            "much of each write survives to the chunk's end in your code and in the loop.")
    answer = guarded(fn, (ssm.ssd_recurrent, ssm.ssd_chunked, ssm.ssd_attention, ssm.linear_scan_loop))
    seed, kinds = seed_for(76), ("small", "near reset", "hard reset") * 2
    if hidden():
        kinds = kinds * 2
    gen = torch.Generator().manual_seed(seed)
    for trial, kind in enumerate(kinds):
        S, x, a, B = _reset_inputs(gen, kind)
        try:
            got, unsolved = _call(answer, S.clone(), x, a.clone(), B)
        except Refused as refused:
            return refusal(name, refused.names, hint, owner="labsrc.ssm")
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        expected = _reset_reference(S, x, a, B)
        problem = _compare_tensors(got, expected, 1e-4, 1e-5)
        if problem:
            place, what = problem
            case = (f"trial {trial + 1} of {len(kinds)}, a chunk of {a.shape[0]} steps with a {kind}, "
                    f"p={x.shape[1]}, n={B.shape[1]}" + (f", {place}" if place else ""))
            return fail(name, case, what, hint)
    return _report(Result(name, PASSED, f"equal to the recurrence on {len(kinds)} chunks, resets included."))


# ------------------------------------------------------------------------------------------ the kernel

# (rows, L, BLOCK_L): rows longer than one block, lengths that are not multiples of it, a row of one element.
_KERNEL_SIZES = ((2, 40, 16), (3, 7, 16), (1, 1, 16), (2, 100, 32), (1, 33, 16), (2, 64, 16))
_GUARD = 64


def _guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.full((values.numel() + 2 * _GUARD,), float("nan"), dtype=values.dtype)
    storage[_GUARD:_GUARD + values.numel()] = values.flatten()
    return storage[_GUARD:_GUARD + values.numel()].view(values.shape), storage


def scan_grad_reference(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient of a loss with respect to ``b`` of ``h = linear_scan(a, b)``, given ``g``, its gradient with
    respect to ``h``: autograd through :func:`labsrc.ssm.linear_scan_loop`, in float64."""
    a64 = a.double()
    b = torch.zeros_like(a64, requires_grad=True)
    h = ssm.linear_scan_loop(a64, b)
    (grad,) = torch.autograd.grad(h, b, g.double())
    return grad.to(g.dtype)


@exercise
def check_scan_grad_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(a_ptr, g_ptr, d_ptr, L, BLOCK_L)`` that writes the gradient of a
    linear scan, ``d_t = g_t + a_{t+1} d_{t+1}`` with ``d_{L-1} = g_{L-1}``, along each row of contiguous float32
    ``(rows, L)`` tensors, one program per row (grid ``(rows,)``), in blocks of ``BLOCK_L`` (a power of two,
    often smaller than ``L``). Compared with autograd through the forward scan. Without Triton (macOS, Windows)
    the check says it is skipped."""
    name = "the scan's gradient, a reverse scan (Triton)"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read '`linear_scan`: `tl.associative_scan` and a carry' and ask, for your kernel, in which order "
            "the blocks must be visited, which lane of a block the next block needs, and which a multiplies "
            "which d.")
    seed, sizes = seed_for(77), _KERNEL_SIZES
    if hidden():
        sizes = sizes + tuple((r + 1, L + 21, B) for r, L, B in sizes)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of rows programs")) is not None:
        return _report(unlaunchable)
    gen = torch.Generator().manual_seed(seed)
    for trial, (rows, L, block) in enumerate(sizes):
        a = torch.rand(rows, L, generator=gen) * 0.5 + 0.6
        g = torch.randn(rows, L, generator=gen)
        ag, _ = _guarded(a)
        gg, _ = _guarded(g)
        d, d_store = _guarded(torch.full_like(a, float("nan")))
        try:
            kernel[(rows,)](ag, gg, d, L, BLOCK_L=block)
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            cause = err.__cause__ or err.__context__
            if stub_raised(err):
                return _report(Result(name, NOT_SOLVED, "Fill in the kernel above, then run this cell again."))
            return _report(Result(name, FAILED, f"trial {trial + 1} (rows={rows}, L={L}, BLOCK_L={block}): the "
                                                f"launch raised {type(cause or err).__name__}: {cause or err}. "
                                                f"Hint: {hint}"))
        problem = None
        guards = torch.cat([d_store[:_GUARD], d_store[-_GUARD:]])
        expected = scan_grad_reference(a, g)
        if not bool(torch.isnan(guards).all()):
            problem = "the kernel wrote outside the output tensor."
        elif torch.isnan(d).any():
            problem = "some output elements were never written."
        elif not torch.allclose(d, expected, rtol=1e-4, atol=1e-5):
            bad = ~torch.isclose(d, expected, rtol=1e-4, atol=1e-5)
            t = int(bad.any(0).nonzero()[-1])           # the wrong element nearest the row's end
            problem = f"the output differs from the reference; the wrong element nearest the row's end is at {t}."
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (rows={rows}, L={L}, BLOCK_L={block}): "
                                                f"{problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to autograd through the scan on {len(sizes)} launches, rows "
                                        "longer than a block included."))
