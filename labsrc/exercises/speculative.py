"""Checks for the exercises of the speculative-decoding chapter.

Each check calls the student's function on its cases and compares it with the truth it computes itself (from
:mod:`labsrc.speculative`, or by running tiny models it builds); it prints ``passed``, what is wrong (with a
hint), or ``not solved yet``. Expected answers are never printed. A check refuses an answer that calls the
library function the exercise asks for.

* :func:`check_spec_acceptance` -- ``fn(p) -> (sampled, greedy)``: the acceptance of three drafts built from a
  target ``p`` (sampled at temperature 1, and greedy), derived in closed form and compared with the exact values
  on the chapter's target and on random ones.
* :func:`check_spec_tokens_by_position` -- ``fn(alphas)``: expected tokens per target call when the
  acceptance depends on the position in the window.
* :func:`check_spec_tree_mask` -- ``fn(parents)``: the ancestor-or-self mask of a draft tree.
* :func:`check_spec_rollback` -- ``fn(target, draft, ids, n, k)``: a greedy speculative loop (the fixed version
  of the buggy one in the chapter), run on two tiny random models and compared with plain greedy decoding.
* :func:`check_spec_residual_sample_kernel` -- a ``@triton.jit`` kernel that samples one token per row from
  the residual distribution (inverse CDF, given uniforms), launched under the interpreter.
"""
from __future__ import annotations

import functools
import math

import torch

from labsrc import speculative
from labsrc.exercises.core import launch_failed, not_a_kernel, skipped_without_triton
from labsrc.exercises.core import (NOT_SOLVED, PASSED, Result, _report, check_function, exercise, hidden, randint,
                                   refuse_library)

from labsrc.exercises._shims import failed, seed_for, trials_for


__all__ = ["acceptance_target", "check_spec_acceptance", "check_spec_tokens_by_position", "check_spec_tree_mask",
           "check_spec_rollback", "check_spec_residual_sample_kernel"]


def _refuse(title, fn, forbidden, hint, args):
    return refuse_library(title, fn, forbidden, hint, owner="labsrc.speculative", args=args)


def _number(x):
    """A one-element tensor or NumPy value as the Python number it holds."""
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        try:
            return x.item()
        except (TypeError, ValueError):
            return x
    return x


# ------------------------------------------------------------------------------------ acceptance prediction
DRAFTS = ("lookup", "mixed", "swapped")
"""The three drafts of the prediction exercise, in the order the answer lists them."""

def acceptance_target() -> torch.Tensor:
    """The target distribution of the prediction exercise: float64 ``(8,)``, a fixed draw whose two most likely
    tokens are clearly apart (so every draft's argmax is well defined)."""
    gen = torch.Generator().manual_seed(2024)
    while True:
        p = torch.softmax(1.3 * torch.randn(8, generator=gen, dtype=torch.float64), -1)
        top = p.sort(descending=True).values
        if top[0] - top[1] > 0.05 and top[1] - top[2] > 0.02:
            return p


def _drafts(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three drafts of the exercise, built from the target ``p`` as the task describes them."""
    one_hot = torch.zeros_like(p)
    one_hot[p.argmax()] = 1.0
    order = p.argsort(descending=True)
    swapped = p.clone()
    swapped[order[0]], swapped[order[1]] = p[order[1]], p[order[0]]
    return {"lookup": one_hot, "mixed": 0.5 * p + 0.5 / p.numel(), "swapped": swapped}


def _acceptances(p: torch.Tensor) -> tuple[list[float], list[float]]:
    """Exact acceptance of each draft: sampled at temperature 1, and greedy (the draft's argmax proposed)."""
    sampled, greedy = [], []
    for q in _drafts(p).values():
        sampled.append(float(speculative.acceptance_rate(p, q)))
        greedy.append(float(q.argmax() == p.argmax()))
    return sampled, greedy


def _three_numbers(values) -> list[float] | None:
    try:
        out = [float(_number(v)) for v in values]
    except (TypeError, ValueError):
        return None
    return out if len(out) == len(DRAFTS) and all(math.isfinite(v) for v in out) else None


def _target_case(gen) -> torch.Tensor:
    """A random target over 5 to 40 tokens whose three most likely tokens are clearly apart (each draft's argmax
    is then well defined), some of them peaked and some flat."""
    while True:
        V = randint(gen, 5, 40)
        sharp = (0.5, 1.3, 2.5)[randint(gen, 0, 2)]
        p = torch.softmax(sharp * torch.randn(V, generator=gen, dtype=torch.float64), -1)
        top = p.sort(descending=True).values
        if top[0] - top[1] > 0.01 and top[1] - top[2] > 0.005:
            return p


def _forbidden_acceptance():
    return (speculative.acceptance_rate, speculative.total_variation, speculative.verify, speculative.verify_batch,
            speculative.residual_distribution, speculative._verify_core, _acceptances, _drafts)


@exercise
def check_spec_acceptance(fn) -> Result:
    """Check ``fn(p) -> (sampled, greedy)``: for a target distribution ``p`` (float64 ``(V,)``), two sequences of
    three numbers, the acceptance probability of one drafted token for the drafts ``lookup``, ``mixed`` and
    ``swapped`` built from ``p`` (see the exercise), first when both models sample at temperature 1, then under
    greedy decoding. Exact (to rounding): a sampled estimate cannot pass. Cases: the chapter's target, then
    random targets of other sizes and shapes."""
    name = "acceptance of three drafts"
    hint = ("for the draft and the mode named, write the draft's distribution next to the target's and follow "
            "one drafted token through the rule that accepts it.")
    refused = _refuse(name, fn, _forbidden_acceptance(), hint, (acceptance_target(),))
    if refused is not None:
        return refused
    trials, seed = (trials_for(8), seed_for(71)) if hidden() else (4, 71)
    gen = torch.Generator().manual_seed(seed)
    cases = ([] if hidden() else [acceptance_target()]) + [_target_case(gen) for _ in range(trials)]
    for trial, p in enumerate(cases):
        where = ("the chapter's target" if trial == 0 and not hidden()
                 else f"trial {trial + 1} (a random target over {p.numel()} tokens)")
        try:
            got = fn(p.clone())
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        try:
            sampled, greedy = (_three_numbers(v) for v in got)
        except (TypeError, ValueError):
            sampled = greedy = None
        if sampled is None or greedy is None:
            return failed(name, f"{where}: return two sequences of three numbers (sampled, "
                                f"greedy). Hint: {hint}")
        want_s, want_g = _acceptances(p)
        for mode, mine, want in (("at temperature 1", sampled, want_s), ("under greedy decoding", greedy, want_g)):
            for draft, a, b in zip(DRAFTS, mine, want):
                if not 0.0 <= a <= 1.0:
                    return failed(name, f"{where}: the {draft} draft's acceptance {mode} is not "
                                        f"a probability. Hint: {hint}")
                if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
                    return failed(name, f"{where}: the {draft} draft's acceptance {mode} is not "
                                        f"the exact one. Hint: {hint}")
    return _report(Result(name, PASSED, "all six acceptances exact on all the check's targets."))


# ------------------------------------------------------------------------------------ tokens by position
def _position_inputs(gen):
    k = randint(gen, 1, 10)
    kind = randint(gen, 0, 3)
    if kind == 0:                          # the source's decay: alpha_1 (1 - eps)^(i - 1)
        a1, eps = float(torch.rand(1, generator=gen)), 0.2 * float(torch.rand(1, generator=gen))
        alphas = [a1 * (1 - eps) ** i for i in range(k)]
    elif kind == 1:                        # a rejection-free start, then a sure rejection
        alphas = [1.0] * (k - 1) + [0.0] if k > 1 else [0.5]
    else:
        alphas = [float(x) for x in torch.rand(k, generator=gen, dtype=torch.float64)]
    return ([round(a, 4) for a in alphas],)


def _tokens_reference(alphas):
    # the window stops at the first rejection; the target always adds one token
    total, reach = 1.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


def _explaining_positions(fn):
    """``explain`` for the tokens by position: the invariants of the two extreme windows (every draft rejected,
    every draft accepted), when the answer breaks one of them."""
    def explain(got, expected, alphas) -> str:
        k = len(alphas)
        for value, tokens, said in ((0.0, 1, "every acceptance 0 (the target's own token alone)"),
                                    (1.0, k + 1, "every acceptance 1 (all k drafts and the target's token)")):
            mine = _number(fn([value] * k))
            if isinstance(mine, (int, float)) and not math.isclose(mine, tokens, rel_tol=1e-9):
                return f"It also breaks the window of {k} drafts with {said}."
        return ""
    return explain


@exercise
def check_spec_tokens_by_position(fn) -> Result:
    """``fn(alphas)``: expected tokens one target call emits when draft ``i`` of the window (1-based) is
    accepted with probability ``alphas[i - 1]`` given that every earlier draft was; ``len(alphas)`` is ``k``."""
    name = "expected tokens per call, acceptance by position"
    hint = ("count, for k = 2, the tokens of each way one call can end, and the probability of each way.")
    refused = _refuse(name, fn, (speculative.expected_tokens_per_step, speculative.speedup), hint,
                      ([0.8, 0.7, 0.6],))
    if refused is not None:
        return refused
    return check_function(name, fn, _tokens_reference, _position_inputs, trials=10, seed=4, rtol=1e-9,
                          hint=hint, explain=_explaining_positions(fn))


# ------------------------------------------------------------------------------------------- tree mask
def _tree_inputs(gen):
    n = randint(gen, 1, 14)
    return ([randint(gen, -1, i - 1) for i in range(n)],)


@exercise
def check_spec_tree_mask(fn) -> Result:
    """``fn(parents)`` -> ``(N, N)`` bool tensor, ``[i, j]`` true when node ``j`` is node ``i`` or an ancestor."""
    name = "tree attention mask"
    hint = ("re-read 'The kernel: tree attention', draw the failing trial's tree from its parents list, and "
            "check the entry named in this message on the drawing.")
    refused = _refuse(name, fn, (speculative.tree_attention_mask,), hint, ([-1, 0, 0, 1],))
    if refused is not None:
        return refused
    return check_function(name, fn, speculative.tree_attention_mask, _tree_inputs, trials=8, seed=5, hint=hint,
                          explain=_explain_tree)


def _explain_tree(got, expected, parents) -> str:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return ""
    wrong = (got.bool() != expected).nonzero()
    if wrong.numel() == 0:
        return "" if got.dtype == torch.bool else f"Return a bool tensor, not {got.dtype}."
    i, j = (int(x) for x in wrong[0])
    if i == j:
        kind = "itself"
    elif expected[i, j]:
        kind = f"an ancestor of node {i}"
    elif expected[j, i]:
        kind = f"a descendant of node {i}"
    else:
        kind = "on another branch"
    return f"Entry [{i}, {j}] is wrong: node {j} is {kind}."


# ------------------------------------------------------------------------------------------- cache rollback
_TINY_VOCAB = 24


@functools.lru_cache(maxsize=1)
def tiny_pair():
    """Two tiny random Llama models on the CPU: a target, and a draft that is the target with its weights
    nudged (it agrees with the target's argmax about two times in three). Built once; a few milliseconds a
    forward pass, so the rollback check can run a speculative loop against plain greedy decoding."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    config = LlamaConfig(vocab_size=_TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=0, pad_token_id=1, tie_word_embeddings=True,
                         initializer_range=0.3)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            target = LlamaForCausalLM(config).eval()
            draft = LlamaForCausalLM(config).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(0.02 * w.std() * torch.randn(w.shape, generator=gen))
    for model in (target, draft):
        model.requires_grad_(False)
    return target, draft


@torch.no_grad()
def _greedy_ref(target, ids, n):
    """Plain greedy decoding without a cache: the whole sequence through the target for every new token."""
    seq = ids.tolist()
    for _ in range(n):
        seq.append(int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return torch.tensor(seq)


def _count_calls(model, counter: dict, key: str):
    """A forward hook on ``model`` that counts its forward passes in ``counter[key]`` (generate's included)."""
    return model.register_forward_hook(lambda *_: counter.__setitem__(key, counter[key] + 1))


_ROLLBACK_CASES = ((7, 2), (5, 3), (9, 4), (6, 2), (8, 3))


@exercise
def check_spec_rollback(fn) -> Result:
    """Check ``fn(target, draft, ids, n, k) -> ids``: greedy speculative decoding of ``n`` new tokens after the
    1-D prompt ``ids`` with a window of ``k`` drafts, returned as the 1-D prompt plus the ``n`` new tokens. It
    runs on two tiny random models (:func:`tiny_pair`) and must equal plain greedy decoding token for token,
    with fewer target calls than new tokens (a verification per window, not a forward per token)."""
    name = "greedy speculation with a rollback"
    hint = ("re-read 'Generation with two caches', then write down, for a window where the first draft is "
            "rejected, which tokens' keys the target's cache holds after the rollback and which it should hold.")
    refused = _refuse(name, fn, (speculative.speculative_generate, speculative._speculate,
                                 speculative._rollback), hint, None)
    if refused is not None:
        return refused
    target, draft = tiny_pair()
    n, seed, cases = 12, 8, _ROLLBACK_CASES
    if hidden():
        seed, cases = seed_for(seed), cases + ((10, 5), (4, 1))
    gen = torch.Generator().manual_seed(seed)
    calls, new_tokens = 0, 0
    for trial, (length, k) in enumerate(cases):
        ids = torch.randint(2, _TINY_VOCAB, (length,), generator=gen)
        counter = {"target": 0, "draft": 0}
        hooks = [_count_calls(target, counter, "target"), _count_calls(draft, counter, "draft")]
        try:
            got = fn(target, draft, ids.clone(), n, k)
        except NotImplementedError:
            return _report(Result(name, NOT_SOLVED, "Fill in the function above, then run this cell again."))
        except Exception as err:  # noqa: BLE001 - the student's loop may fail in any way; say how
            return failed(name, f"trial {trial + 1} (prompt of {length} tokens, k = {k}): it "
                                f"raised {type(err).__name__}: {err}. Hint: {hint}")
        finally:
            for h in hooks:
                h.remove()
        where = f"trial {trial + 1} (prompt of {length} tokens, k = {k}, {n} new tokens)"
        if not isinstance(got, torch.Tensor) or got.dim() != 1:
            return failed(name, f"{where}: expected a 1-D tensor of token ids, got "
                                f"{type(got).__name__}. Hint: {hint}")
        want = _greedy_ref(target, ids, n)
        if got.numel() != want.numel():
            return failed(name, f"{where}: the answer does not hold one id for every token of the prompt and "
                                f"every new token. Hint: {hint}")
        if not torch.equal(got[:length].cpu(), ids):
            return failed(name, f"{where}: the returned ids do not start with the prompt. "
                                f"Hint: {hint}")
        if not torch.equal(got.cpu().long(), want):
            first = int((got.cpu().long() != want).nonzero()[0]) - length
            return failed(name, f"{where}, new token {first}: it differs from plain greedy decoding (the "
                                f"tokens before it agree). Hint: {hint}")
        calls += counter["target"]
        new_tokens += n
        if counter["draft"] == 0:
            return failed(name, f"{where}: the draft was never called, so nothing was "
                                f"speculated. Hint: {hint}")
    if calls >= new_tokens:
        return failed(name, "on the check's prompts the target ran a forward pass for every new token: that is "
                            f"plain decoding, not one verification per window. Hint: {hint}")
    return _report(Result(name, PASSED, "equal to greedy decoding on all the check's prompts, one target call "
                                        "per window."))


# ------------------------------------------------------------------------------------------- the kernel
_KERNEL_CASES = ((3, 7), (1, 1), (5, 33), (2, 100), (4, 2), (6, 65))
_GUARD = 16
_POISON = -7
_MARGIN = 1e-4


def _sample_ref(p, q, u):
    """Inverse-CDF sample of each row from its residual (float64): the first index whose cumulative weight
    exceeds ``u`` times the row's total; the target's own row where the residual is empty."""
    p, q, u = p.double(), q.double(), u.double()
    w = (p - q).clamp(min=0)
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, p)
    c = w.cumsum(-1)
    return (c <= u[:, None] * c[:, -1:]).sum(-1).clamp(max=p.shape[-1] - 1)


def _kernel_inputs(gen, rows, v):
    """``p``, ``q`` (float32, contiguous) and uniforms ``u`` kept away from every CDF step (so rounding in the
    kernel's cumulative sum cannot move a sample). Row 0 has ``q == p``; row 1 (when there is one) a one-hot
    draft, as prompt lookup proposes."""
    p = torch.softmax(2 * torch.randn(rows, v, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(rows, v, generator=gen), -1)
    q[0] = p[0]
    if rows > 1:
        q[1] = torch.nn.functional.one_hot(torch.randint(0, v, (1,), generator=gen), v)[0].float()
    u = torch.empty(rows, dtype=torch.float64)
    for r in range(rows):
        w = (p[r].double() - q[r].double()).clamp(min=0)
        w = w if w.sum() > 0 else p[r].double()
        cdf = w.cumsum(0) / w.sum()
        while True:
            x = float(torch.rand(1, generator=gen, dtype=torch.float64)) * (1 - 2 * _MARGIN)
            if float((cdf - x).abs().min()) > _MARGIN:
                u[r] = x
                break
    return p.contiguous(), q.contiguous(), u.float().contiguous()


def _explain_samples(got, p, q, u) -> str:
    """Which rows are wrong, and whether the tokens are the target's own samples (no residual taken)."""
    want = _sample_ref(p, q, u)
    bad = (got != want).nonzero().flatten().tolist()
    from_p = _sample_ref(p, torch.zeros_like(q), u)
    said = "only row 0, where p == q" if bad == [0] else f"rows {bad[:5]}"
    extra = ""
    if len(bad) > 1 and torch.equal(got[bad], from_p[bad]):
        extra = " Those rows hold the token the target's own distribution gives for u, not the residual's."
    elif ((got < 0) | (got >= p.shape[-1])).any():
        extra = " Some tokens are outside the vocabulary."
    return f"the sampled token is wrong in {said}.{extra}"


@exercise
def check_spec_residual_sample_kernel(kernel) -> Result:
    """Check a ``@triton.jit`` kernel ``kernel(p_ptr, q_ptr, u_ptr, out_ptr, V, BLOCK)`` launched on grid
    ``(R,)``, one program per row of ``p`` and ``q`` (contiguous float32 ``(R, V)``): it writes into the int64
    ``out[r]`` the token drawn from row ``r``'s residual by inverse CDF with the uniform ``u[r]`` (float32
    ``(R,)``): the first index whose cumulative residual weight exceeds ``u[r]`` times the row's total weight,
    the target's own row ``p`` standing in where the residual is empty (``p == q``). ``BLOCK`` is the next
    power of two >= ``V``. Without Triton the check says it is skipped."""
    name = "residual-sampling kernel"
    if (skipped := skipped_without_triton(name)) is not None:
        return skipped
    hint = ("re-read the task of this exercise (row 0 of every trial is a row where draft and target agree, "
            "row 1 a one-hot draft) and the masks of the chapter's kernel; follow one of the rows named in this "
            "message by hand.")
    seed, cases = 7, _KERNEL_CASES
    if hidden():
        seed, cases = seed_for(seed), cases + tuple((r + 1, v + 3) for r, v in cases)
    if (unlaunchable := not_a_kernel(name, kernel, "a grid of R programs")) is not None:
        return _report(unlaunchable)
    import triton

    gen = torch.Generator().manual_seed(seed)
    for trial, (rows, v) in enumerate(cases):
        p, q, u = _kernel_inputs(gen, rows, v)
        store = torch.full((rows + 2 * _GUARD,), _POISON, dtype=torch.int64)
        out = store[_GUARD:_GUARD + rows]
        where = f"trial {trial + 1} (R={rows}, V={v})"
        try:
            kernel[(rows,)](p, q, u, out, v, BLOCK=triton.next_power_of_2(v))
        except Exception as err:  # noqa: BLE001 - the interpreter wraps the student's exception
            return _report(launch_failed(name, err, where, hint))
        guards = torch.cat([store[:_GUARD], store[-_GUARD:]])
        if not bool((guards == _POISON).all()):
            return failed(name, f"{where}: the kernel wrote outside the output tensor. "
                                f"Hint: {hint}")
        if (out == _POISON).any():
            return failed(name, f"{where}: some rows were never written. Hint: {hint}")
        if not torch.equal(out, _sample_ref(p, q, u)):
            return failed(name, f"{where}: {_explain_samples(out, p, q, u)} Hint: {hint}")
    return _report(Result(name, PASSED, "agrees with the reference on all the check's launches."))
