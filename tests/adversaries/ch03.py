"""Chapter 3's exercises against wrong answers (see tests/adversarial.py)."""
from labsrc.exercises import flash_attention as _checker
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only

CH = "03_flash_attention"


def _checker_reference(name):
    def make(right):
        return lambda *a: getattr(_checker, name)(*a)
    return make


def _library_attention(right):
    """Merge through the lab's own decode-attention merge helpers: refused."""
    def answer(m1, l1, o1, m2, l2, o2):
        import labsrc.kernels.attention as lib
        lib.flash_attention  # noqa: B018 - the module is named, which is refused
        return o1
    return answer


EXERCISES = [
    Exercise(CH, "check_merge",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "merge_partials_buggy"),
              bypass("the checker's own reference", _checker_reference("_merge_reference")),
              bypass("the lab's attention kernels", _library_attention)]),
    Exercise(CH, "check_naive_bytes",
             [*constants(), *scaled(), visible_only(),
              bypass("the checker's own reference", _checker_reference("_naive_reference"))]),
    Exercise(CH, "check_tiled_causal_bytes",
             [*constants(), *scaled(), visible_only(),
              bypass("the checker's closed form", _checker_reference("_tiled_causal_reference"))]),
    Exercise(CH, "check_key_tile",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "key_tile_buggy", {"ex": _checker}),
              bypass("the checker's own reference", _checker_reference("_tile_reference"))],
             setup={"ex": _checker}),
    Exercise(CH, "check_dq_kernel", [silent_kernel()]),
]
