"""Chapter 1's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, scaled, silent_kernel, visible_only


def _kvmath(name):
    def make(right):
        from labsrc import kvmath
        return lambda *a: getattr(kvmath, name)(*a)
    return make


def _checker(name):
    def make(right):
        from labsrc.exercises import kv_cache
        return lambda *a: getattr(kv_cache, name)(*a)
    return make


def _measure_paged(right):
    """Serve a mix of its own with the library's measurement (the check's own function): refused."""
    def answer(mean, block):
        import torch

        from labsrc import kvmath
        lengths = torch.full((100,), int(mean))
        return kvmath.paged_utilisation(lengths, block)
    return answer


def _library_kernel(right):
    from labsrc.kernels import kv_store
    return kv_store._kv_store_kernel


CH = "01_kv_cache"
EXERCISES = [
    Exercise(CH, "check_gqa_bytes",
             [*constants(), *scaled(), visible_only(), bypass("labsrc.kvmath.gqa_cache_bytes", _kvmath("gqa_cache_bytes")),
              bypass("the checker's own reference", _checker("_gqa_reference"))]),
    Exercise(CH, "check_decode_rate_ceiling",
             [*constants(), *scaled(), visible_only(), bypass("the checker's own reference", _checker("_rate_reference"))]),
    Exercise(CH, "check_paged_utilisation",
             [*constants((0, 1, 0.9, 0.95)), *scaled(), visible_only(),
              bypass("kvmath.paged_utilisation on a mix of its own", _measure_paged)]),
    Exercise(CH, "check_mla_equivalent_heads",
             [*constants(), *scaled(), visible_only(),
              bypass("labsrc.kvmath.mla_equivalent_kv_heads", _kvmath("mla_equivalent_kv_heads"))]),
    Exercise(CH, "check_kv_store_kernel", [silent_kernel(), bypass("the library's kernel", _library_kernel)]),
]
