"""Chapter 8's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only


def _setup():
    from labsrc import linear_attention as la
    return {"la": la}


def _checker(name):
    def make(right):
        from labsrc.exercises import linear_attention as checker
        return lambda *a: getattr(checker, name)(*a)
    return make


def _one_projection(right):
    """A budget read off one projection per candidate, without averaging: its luck decides."""
    def answer(q, k, v, bound):
        import torch

        from labsrc import linear_attention as la
        exact = la.softmax_attention(q, k, v, causal=False)
        m = 2
        while float((la.favor_attention(q, k, v, la.orthogonal_projection(
                m, q.shape[-1], torch.Generator().manual_seed(m), dtype=q.dtype), "positive") - exact
                ).abs().mean()) > bound:
            m += 1
        return m
    return answer


def _measure_with_the_checker(right):
    def answer(q, k, v, bound):
        from labsrc.exercises import linear_attention as checker
        m = 2
        while checker._mean_favor_error(q, k, v, m, 0) > bound:
            m += 1
        return m
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "08_linear_attention"
EXERCISES = [
    Exercise(CH, "check_association_costs", [*constants(), *scaled(), visible_only()]),
    Exercise(CH, "check_read_after_two_writes",
             [*constants(), *scaled(), visible_only(),
              bypass("the chapter's recurrence, through the checker", _checker("read_measurement"))]),
    Exercise(CH, "check_chunked_attention",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "chunked_attention"),
              bypass("the checker's token-by-token reference", _checker("decayed_attention_reference"))]),
    # An experiment's right answers form a window (m meets the bound, m / 4 does not): m + 1 and 2 m are right
    # too, so the wrong answers are halving the budget and multiplying it by eight.
    Exercise(CH, "check_features_needed",
             [*constants(), *scaled((("x0.5", lambda x: x * 0.5), ("x8", lambda x: x * 8))),
              visible_only(lambda x: x * 8),
              bypass("one projection per candidate, no averaging", _one_projection),
              bypass("the checker's own measurement", _measure_with_the_checker)],
             setup=_setup()),
    Exercise(CH, "check_recurrent_kernel", [silent_kernel()], setup=_kernel_setup()),
]
