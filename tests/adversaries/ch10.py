"""Chapter 10's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only


def _setup():
    from transformers import DynamicCache

    import labsrc.exercises.speculative as checker
    return {"ex": checker, "DynamicCache": DynamicCache}


def _monte_carlo(right):
    """The measurement the chapter's next cell used to make: 20,000 sampled windows per draft."""
    def answer(p):
        import torch
        g = torch.Generator().manual_seed(7)
        n, V = 20_000, p.numel()
        top2 = p.argsort(descending=True)[:2]
        swapped = p.clone()
        swapped[top2] = p[top2.flip(0)]
        sampled = []
        for q in (torch.nn.functional.one_hot(p.argmax(), V).double(), (p + 1 / V) / 2, swapped):
            x = torch.multinomial(q, n, replacement=True, generator=g)
            u = torch.rand(n, generator=g, dtype=torch.float64)
            sampled.append(float((u < (p[x] / q[x]).clamp(max=1)).double().mean()))
        return sampled, [1.0, 1.0, 0.0]
    return answer


def _verify_batch(right):
    """The same measurement through the library's verification."""
    def answer(p):
        import torch

        from labsrc import speculative as spec
        g = torch.Generator().manual_seed(7)
        n, V = 20_000, p.numel()
        sampled = []
        for q in (torch.nn.functional.one_hot(p.argmax(), V).double(), (p + 1 / V) / 2):
            x = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
            _, n_s = spec.verify_batch(x, q.expand(n, 1, V), p.expand(n, 2, V), generator=g)
            sampled.append(float(n_s.double().mean()))
        return sampled + [sampled[0]], [1.0, 1.0, 0.0]
    return answer


def _acceptance_rate(right):
    def answer(p):
        from labsrc import speculative as spec
        return [float(spec.acceptance_rate(p, p))] * 3, [1.0, 1.0, 0.0]
    return answer


def _iid_formula(right):
    def answer(alphas):
        from labsrc import speculative as spec
        return spec.expected_tokens_per_step(sum(alphas) / len(alphas), len(alphas))
    return answer


def _library_generate(right):
    def answer(target, draft, ids, n, k):
        from labsrc import speculative as spec
        return spec.speculative_generate(target, draft, ids, n, k=k)[0]
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH, MOD = "10_speculative", "speculative"
EXERCISES = [
    Exercise(CH, "check_spec_acceptance",
             [*constants(), *scaled(), visible_only(),
              bypass("the Monte Carlo of the cell that followed", _monte_carlo),
              bypass("spec.verify_batch over many windows", _verify_batch),
              bypass("spec.acceptance_rate", _acceptance_rate)],
             setup=_setup(), module=MOD),
    Exercise(CH, "check_spec_tokens_by_position",
             [*constants(), *scaled(), visible_only(), bypass("the i.i.d. formula of the library", _iid_formula)],
             module=MOD),
    # a mask's entries are booleans: doubling or halving one leaves it as it is, so only constants apply
    Exercise(CH, "check_spec_tree_mask", [*constants(), visible_only(lambda x: 1 - x)], module=MOD),
    Exercise(CH, "check_spec_rollback",
             [*constants((0, 1)), *scaled((("x2", lambda x: x * 2),)), visible_only(lambda x: x + 1),
              handed_out(CH, "greedy_speculative_buggy", _setup()),
              bypass("spec.speculative_generate", _library_generate)],
             setup=_setup(), module=MOD),
    Exercise(CH, "check_spec_residual_sample_kernel", [silent_kernel()], setup=_kernel_setup(), module=MOD),
]
