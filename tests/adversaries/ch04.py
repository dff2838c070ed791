"""Chapter 4's exercises against wrong answers (see tests/adversarial.py)."""
import math

from tests.adversarial import Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only

CH = "04_rope"


def _measurement_loop(right):
    """Issue 44's bypass: the chapter's later cell stepped positions through the library's rescaled frequencies
    until a new angle appeared; as a function, it passed. labsrc.rope is refused while the answer runs."""
    def answer(head_dim, base, train_length, method, factor):
        import torch

        from labsrc import rope
        inv0, _ = rope.rope_frequencies(head_dim, base)
        seen = (train_length - 1) * inv0.double()
        slow = seen < 2 * math.pi
        inv_m, _ = rope.rope_frequencies(head_dim, base, method, factor=factor,
                                         original_max_position=train_length)
        n = train_length
        while not bool(((n - 1) * inv_m.double()[slow] > seen[slow]).any()):
            n += 1
        return n + 0 * int(torch.zeros(()).item())
    return answer


def _library_wavelengths(right):
    def answer(i, head_dim, base):
        from labsrc import rope
        return float(rope.wavelengths(head_dim, base)[i])
    return answer


EXERCISES = [
    Exercise(CH, "check_wavelength",
             [*constants(), *scaled(), visible_only(), bypass("labsrc.rope.wavelengths", _library_wavelengths)]),
    Exercise(CH, "check_first_new_angle",
             [*constants((0, 1, 4096)), *scaled(), visible_only(lambda x: x + 1),
              bypass("the later cell's measurement loop", _measurement_loop)]),
    Exercise(CH, "check_rotate_new_tokens",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "rotate_new_tokens_buggy")]),
    Exercise(CH, "check_rope_kernel", [silent_kernel()]),
]
