"""Chapter 15's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, scaled, silent_kernel, visible_only


def _softmax_of_the_scores(right):
    """The known bypass of the old exercise: torch.softmax of the scores the prompt describes, here searched
    for the length where the differential weight changes sign."""
    def answer(needle, distractor, lam):
        import torch

        def weight(T):
            s1 = torch.zeros(T, dtype=torch.float64)
            s2 = torch.zeros(T, dtype=torch.float64)
            s1[0], s1[1], s2[1] = needle, distractor, distractor
            return float(torch.softmax(s1, 0)[1] - lam * torch.softmax(s2, 0)[1])
        T = 3
        while weight(T) < 0 and T < 10 ** 6:
            T += 1
        return float(T)
    return answer


def _diff_attention_ref(right):
    def answer(needle, distractor, lam):
        import torch

        from labsrc.kernels import frontier as kfr
        q = torch.ones(1, 1, 8, 16, dtype=torch.float64)
        _, a1, a2 = kfr.diff_attention_ref(q, q, q, q, q, lam, return_maps=True)
        return float(a1.sum() - a2.sum())
    return answer


def _library_fraction(right):
    def answer(capacity, T, d):
        from labsrc import frontier
        return frontier.mod_flops_fraction(capacity, T)
    return answer


def _search_with_kvmath(right):
    def answer(n_layers, window, fraction):
        from labsrc import kv_cache as kvmath
        for T in range(1, 10 ** 6, 97):
            yoco = kvmath.kv_cache_bytes(n_layers // 2, 1, 1, min(T, window)) + kvmath.kv_cache_bytes(1, 1, 1, T)
            if yoco / kvmath.kv_cache_bytes(n_layers, 1, 1, T) <= fraction:
                return T
        return None
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "15_frontier"
EXERCISES = [
    Exercise(CH, "check_distractor_sign_change",
             [*constants(), *scaled(), visible_only(), bypass("torch.softmax of the described scores",
                                                              _softmax_of_the_scores),
              bypass("the chapter's diff_attention_ref", _diff_attention_ref)]),
    Exercise(CH, "check_mod_block_fraction", [*constants(), *scaled(), visible_only(),
                                              bypass("labsrc.frontier.mod_flops_fraction", _library_fraction)]),
    Exercise(CH, "check_yoco_length", [*constants(), *scaled(), visible_only(),
                                       bypass("a search with kvmath's byte count", _search_with_kvmath)]),
    Exercise(CH, "check_diff_norm_kernel", [silent_kernel()], setup=_kernel_setup()),
]
