"""Chapter 13's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only


def _setup():
    from labsrc.exercises import distillation as checker
    return {"ex": checker}


def _library_jsd(right):
    def answer(s, t, beta, T):
        from labsrc import distillation as distill
        return float(distill.generalized_jsd(s, t, beta=beta, T=T))
    return answer


def _by_autograd(how):
    """The known bypass: autograd switched back on inside the answer (issue 44), in three ways."""
    def make(right):
        def loss(z, t, T):
            import torch.nn.functional as F
            log_q = F.log_softmax(z / T, -1)
            log_p = F.log_softmax(t / T, -1)
            return T * T * (log_q.exp() * (log_q - log_p)).sum()

        def answer(s, t, T):
            import torch
            if how == "func":
                return torch.func.grad(lambda z: loss(z, t.double(), T))(s.double()).float()
            manager = torch.enable_grad() if how == "enable_grad" else torch.set_grad_enabled(True)
            with manager:
                z = s.double().clone().requires_grad_(True)
                loss(z, t.double(), T).backward()
                return z.grad.float()
        return answer
    return make


def _fit_in_the_answer(right):
    def answer(w, mu1, sd1, mu2, sd2):
        import torch

        from labsrc import distillation as distill
        from labsrc.exercises import distillation as checker
        p = checker.bimodal_teacher(w, mu1, sd1, mu2, sd2)
        out = []
        for beta in (0.0, 1.0):
            mu, sd = distill.fit_unimodal(p, checker.GRID, beta)
            b = torch.exp(-0.5 * ((checker.GRID.double() - mu) / sd) ** 2)
            out.append(float(torch.minimum(p, b / b.sum()).sum()))
        return tuple(out)
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "13_distillation"
EXERCISES = [
    Exercise(CH, "check_jsd_fix", [*constants(), *scaled(), visible_only(), handed_out(CH, "jsd_buggy"),
                                   bypass("labsrc.distillation.generalized_jsd", _library_jsd)], setup=_setup()),
    Exercise(CH, "check_reverse_kl_gradient",
             [*constants(), *scaled(), visible_only(),
              bypass("autograd inside torch.enable_grad()", _by_autograd("enable_grad")),
              bypass("autograd inside torch.set_grad_enabled(True)", _by_autograd("set_grad_enabled")),
              bypass("torch.func.grad", _by_autograd("func"))]),
    Exercise(CH, "check_fit_acceptance", [*constants(), *scaled(), visible_only(),
                                          bypass("distill.fit_unimodal in the answer", _fit_in_the_answer)],
             setup=_setup()),
    Exercise(CH, "check_kd_row_kernel", [silent_kernel()], setup=_kernel_setup()),
]
