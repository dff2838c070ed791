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

import torch

from labsrc import runtime, ssm
from labsrc.exercises.core import not_a_kernel, skipped_without_triton, stub_raised
from labsrc.exercises.core import (FAILED, HIDDEN_SEED_OFFSET, NOT_SOLVED, PASSED, Result, _call, _compare_tensors,
                                   _report, check_function, diagnose_number, exercise, hidden, randint,
                                   refuse_library)

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
                          rtol=1e-9, atol=1e-12, hint=hint, explain=_explain_zoh)


def _explain_zoh(got, expected, a, b, dt) -> str:
    """Which of (Ab, Bb) is wrong, and whether the pair is the forward-Euler step instead of the exact hold."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return "Return the pair (Ab, Bb), each of a's shape."
    euler = torch.stack([1 + dt * a, dt * b])
    if torch.allclose(got, euler, rtol=1e-9, atol=1e-12):
        return "That is the forward-Euler step, a first-order approximation; the task asks for the exact hold."
    ok = [torch.allclose(got[i], expected[i], rtol=1e-9, atol=1e-12) for i in range(2)]
    if ok[0] and not ok[1]:
        return "Ab is right; Bb is wrong."
    if ok[1] and not ok[0]:
        return "Bb is right; Ab is wrong."
    return ""


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


def _cache_formula(config, batch) -> int:
    """The cache's size from the shapes of its tensors, for the diagnosis only (the check compares with a
    measurement)."""
    conv_dim = config.num_heads * config.head_dim + 2 * config.n_groups * config.state_size
    return ssm.ssm_state_bytes(config.num_hidden_layers, config.num_heads, config.head_dim, config.state_size,
                               conv_dim=conv_dim, conv_kernel=config.conv_kernel, bytes_per_el=4, batch=batch)


def _cache_diagnosis(fn, config, batch) -> str:
    """The field (or the batch) whose doubling moves the prediction unlike the cache: what the prediction
    leaves out, counts twice or puts in the wrong place."""
    try:
        base_got, base_want = float(fn(config, batch)), _cache_formula(config, batch)
        changes = [("batch", config, 2 * batch)]
        for field in _CACHE_FIELDS:
            doubled = config.__class__.from_dict(config.to_dict())
            setattr(doubled, field, 2 * getattr(config, field))
            if field in ("num_heads", "head_dim"):
                doubled.hidden_size = doubled.num_heads * doubled.head_dim // doubled.expand
            changes.append((field, doubled, batch))
        for field, cfg, b in changes:
            want, got = _cache_formula(cfg, b) / base_want, float(fn(cfg, b)) / base_got
            if not math.isclose(want, got, rel_tol=1e-9):
                return (f" Doubling {field} multiplies the cache by {want:.4g} but your prediction by {got:.4g}: "
                        f"look at how {field} enters your count.")
    except Exception:  # noqa: BLE001 - a prediction that fails on the changed config is reported plainly
        pass
    return ""


@exercise
def check_mamba_cache_bytes(fn) -> Result:
    """Check ``fn(config, batch) -> bytes``: the prediction, from a transformers ``Mamba2Config`` alone, of the
    bytes of the cache a float32 ``Mamba2ForCausalLM`` keeps for ``batch`` sequences after a prefill. The
    truth is measured: the check builds small random models, prefills random prompts and counts every tensor
    their caches hold."""
    name = "the recurrent cache of a Mamba-2"
    hint = ("re-read 'Memory per generated token' and, for one layer of the Mamba-2 block, list what a decode step "
            "needs from the past: the SSM state and the window of the short convolution (over which channels?).")
    example = _mamba_config(torch.Generator().manual_seed(75))
    refused = _refuse(name, fn, (ssm.ssm_state_bytes,), hint, (example, 1))
    if refused is not None:
        return refused
    seed, trials = 75, 4
    if hidden():
        seed, trials = seed + HIDDEN_SEED_OFFSET, 2 * trials
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        config, batch = _mamba_config(gen), randint(gen, 1, 3)
        got, unsolved = _call(fn, config, batch)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        shape = ", ".join(f"{f} {getattr(config, f)}" for f in _CACHE_FIELDS)
        case = f"trial {trial + 1} ({shape}, expand {config.expand}; {batch} sequence(s))"
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return _report(Result(name, FAILED, f"{case}: expected a number of bytes, got {type(got).__name__}. "
                                                f"Hint: {hint}"))
        measured = _measured_cache_bytes(config, batch, gen)
        if not math.isclose(got, measured, rel_tol=1e-9):
            direction = "too large" if got > measured else "too small"
            problem = (f"your prediction is {direction} against the measured cache."
                       f"{diagnose_number(got, measured)}{_cache_diagnosis(fn, config, batch)}")
            return _report(Result(name, FAILED, f"{case}: {problem} Hint: {hint}"))
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
    hint = ("re-read the paragraph under the four steps of 'Mamba-2's SSD: recurrence, masked attention and "
            "chunks' and print, for the failing chunk, the exponent your code gives each position next to the "
            "same exponent summed by hand.")
    example = _reset_inputs(torch.Generator().manual_seed(76), "small")
    refused = _refuse(name, fn, (ssm.ssd_recurrent, ssm.ssd_chunked, ssm.ssd_attention), hint, example)
    if refused is not None:
        return refused
    seed, kinds = 76, ("small", "near reset", "hard reset") * 2
    if hidden():
        seed, kinds = seed + HIDDEN_SEED_OFFSET, kinds * 2
    gen = torch.Generator().manual_seed(seed)
    for trial, kind in enumerate(kinds):
        S, x, a, B = _reset_inputs(gen, kind)
        got, unsolved = _call(fn, S.clone(), x, a.clone(), B)
        if unsolved is not None:
            unsolved.name = name
            return _report(unsolved)
        expected = _reset_reference(S, x, a, B)
        problem = _compare_tensors(got, expected, 1e-4, 1e-5)
        if problem:
            at = int((a < -1).nonzero()[0]) if kind != "small" else None
            where = "" if at is None else f" (log-decay {float(a[at]):.3g} at position {at})"
            if kind != "small":
                small = _reset_inputs(torch.Generator().manual_seed(seed + trial), "small")
                small_got, _ = _call(fn, small[0].clone(), small[1], small[2].clone(), small[3])
                if _compare_tensors(small_got, _reset_reference(*small), 1e-4, 1e-5) is None:
                    where += "; your state is right on a chunk whose gates are all small"
            return _report(Result(name, FAILED, f"trial {trial + 1}, a chunk of {a.shape[0]} steps with a {kind}"
                                                f"{where}: {problem} Hint: {hint}"))
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


def _explain_grad(got: torch.Tensor, a: torch.Tensor, g: torch.Tensor, expected: torch.Tensor) -> str:
    """A wrong gradient that is a known other scan: in the wrong direction, or with each step's own factor."""
    def close(x):
        return bool(torch.allclose(got, x.float(), rtol=1e-4, atol=1e-5))

    if close(ssm.linear_scan_loop(a.double(), g.double())):
        return " It equals the forward scan of (a, g): this recurrence runs the other way along the row."
    unshifted = ssm.linear_scan_loop(a.double().flip(-1), g.double().flip(-1)).flip(-1)
    if close(unshifted):
        return (" It runs the right way but multiplies by each position's own a: re-read which a links a "
                "position to the one after it.")
    return ""


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
            "which d. A first wrong element past a block boundary points at the carry; writes outside or never "
            "made point at the masks.")
    seed, sizes = 77, _KERNEL_SIZES
    if hidden():
        seed, sizes = seed + HIDDEN_SEED_OFFSET, sizes + tuple((r + 1, L + 21, B) for r, L, B in sizes)
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
            problem = "the kernel wrote outside the output tensor (a lane past the row stored without a mask?)."
        elif torch.isnan(d).any():
            problem = f"{int(torch.isnan(d).sum())} output element(s) were never written."
        elif not torch.allclose(d, expected, rtol=1e-4, atol=1e-5):
            bad = ~torch.isclose(d, expected, rtol=1e-4, atol=1e-5)
            t = int(bad.any(0).nonzero()[-1])           # the wrong element nearest the row's end
            back = L - 1 - t
            where = ("within the row's last BLOCK_L positions" if back < block else
                     f"{back} positions before the row's end, past a block boundary when blocks are counted "
                     f"from the end")
            problem = (f"{int(bad.sum())} of {bad.numel()} elements differ; the one nearest the row's end is at "
                       f"position {t}, {where}.{_explain_grad(d, a, g, expected)}")
        if problem:
            return _report(Result(name, FAILED, f"trial {trial + 1} (rows={rows}, L={L}, BLOCK_L={block}): "
                                                f"{problem} Hint: {hint}"))
    return _report(Result(name, PASSED, f"equal to autograd through the scan on {len(sizes)} launches, rows "
                                        "longer than a block included."))
