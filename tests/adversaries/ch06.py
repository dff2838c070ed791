"""Chapter 6's exercises against wrong answers (see tests/adversarial.py)."""
from labsrc import evict
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only

CH = "06_kv_eviction"


def _library_scores(right):
    def answer(attn, values, alpha, beta, gamma, lam):
        return evict.value_aware_scores(attn, values, alpha, beta, gamma, lam)
    return answer


def _library_lru(right):
    def answer(attn, budget, threshold):
        import torch
        stats = evict.TokenStats.from_attention(attn[None], torch.ones(attn.shape[1], 1), threshold=threshold)
        return evict.LRU(threshold=threshold).select(stats, budget)
    return answer


EXERCISES = [
    Exercise(CH, "check_scores",
             [*constants(), *scaled(), visible_only(), bypass("labsrc.evict.value_aware_scores", _library_scores)]),
    Exercise(CH, "check_lru_keep",
             [*constants((0, 1)), visible_only(lambda x: x * 0), handed_out(CH, "lru_keep_buggy"),
              bypass("labsrc.evict.LRU", _library_lru)], name="my_lru_keep"),
    Exercise(CH, "check_wrongly_dropped",
             [*constants((0, 1, 15)), *scaled(), visible_only()], name="wrongly_dropped"),
    Exercise(CH, "check_attention_sums_kernel", [silent_kernel()]),
    Exercise(CH, "check_ever_kept", [*constants(), *scaled(), visible_only()], setup={"ev": evict}),
]
