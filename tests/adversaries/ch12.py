"""Chapter 12's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only


def _setup():
    from labsrc import weight_quant as wq
    from labsrc.exercises import weight_quant as checker
    return {"ex": checker, "wq": wq}


def _measured_ratio(right):
    def answer(n_groups, outlier):
        from labsrc.exercises import weight_quant as checker
        return checker.measured_outlier_ratio(n_groups, outlier)
    return answer


def _steps_ratio(right):
    """The ratio of the two steps alone (the outlier's own group forgotten)."""
    return lambda n_groups, outlier: float(outlier)


def _mxfp4_pair(right):
    """The known bypass of the fixed-answer version: MXFP4's two numbers (found by bisection), for every format."""
    return lambda grid: (0.25, 0.2)


def _library_sweep(right):
    """A sweep through the library's MXFP4 quantizer, whatever the format."""
    def answer(grid):
        import torch

        from labsrc import weight_quant as wq
        m = torch.linspace(1.0, 2.0, 4001)[:-1] * 4.0
        block = torch.zeros(m.numel(), 32)
        block[:, 0] = m
        codes, scales = wq.mxfp4_quantize(block)
        return float(((wq.mxfp4_dequantize(codes, scales)[:, 0] - m).abs() / m).max()), 0.2
    return answer


def _library_gptq(right):
    def answer(W, H, scale, block):
        from labsrc import weight_quant as wq
        return wq.dequantize(wq.gptq_quantize(W.float(), H.float(), 4, None)).double()
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "12_weight_quant"
EXERCISES = [
    Exercise(CH, "check_rtn_outlier_ratio",
             [*constants(), *scaled(), visible_only(), bypass("the checker's measurement", _measured_ratio),
              bypass("the ratio of the two steps", _steps_ratio)]),
    Exercise(CH, "check_mxfp4_worst_error",
             [*constants(), *scaled(), visible_only(), bypass("MXFP4's pair for every format", _mxfp4_pair),
              bypass("a sweep of the library's MXFP4 quantizer", _library_sweep)]),
    Exercise(CH, "check_gptq_fix",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "gptq_blocked_buggy"),
              bypass("labsrc.weight_quant.gptq_quantize", _library_gptq)]),
    Exercise(CH, "check_cheapest_config", [*constants(), *scaled(), visible_only()], setup=_setup()),
    Exercise(CH, "check_int4_gemv_kernel", [silent_kernel()], setup=_kernel_setup()),
]
