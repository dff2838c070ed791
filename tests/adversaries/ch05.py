"""Chapter 5's exercises against wrong answers (see tests/adversarial.py)."""
from labsrc import kvquant
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only

CH = "05_kv_quant"


def _library_scale_zero(right):
    def answer(group, bits):
        return kvquant.scale_zero(group, bits)
    return answer


def _checker_measurement(right):
    """Search the group size with the checker's own measurement: refused."""
    def answer(x, bits, max_ratio):
        from labsrc.exercises import kv_quant
        g = 1
        while 2 * g <= x.shape[0] and kv_quant._mse_ratio_at(x, bits, 2 * g) <= max_ratio:
            g *= 2
        return g
    return answer


def _power_of_two(factor):
    def make(right):
        def answer(*a):
            g = right(*a)
            return max(1, int(g * factor))
        return answer
    return make


EXERCISES = [
    Exercise(CH, "check_scale_zero",
             [*constants(), *scaled(), visible_only(), bypass("labsrc.kvquant.scale_zero", _library_scale_zero)]),
    Exercise(CH, "check_fp16_params",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "fp16_params_buggy")]),
    Exercise(CH, "check_group_size",
             [*constants((1, 2, 64)), bypass("twice the right group", _power_of_two(2)),
              bypass("half the right group", _power_of_two(0.5)), visible_only(lambda g: max(1, g // 2)),
              bypass("the checker's own measurement", _checker_measurement)],
             setup={"kq": kvquant}),
    Exercise(CH, "check_unpack_kernel", [silent_kernel()]),
]
