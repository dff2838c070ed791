"""What chapter 4's diagnosis of NTK's failure at its own 4L and dynamic NTK's dip rests on (issue 45, item 8):
dynamic NTK at a length x is static NTK with s = x / L, and NTK-aware scaling leaves the pairs that never
turned in training partly extrapolated at the length it was configured for, where YaRN keeps them in range."""
import math

import pytest
import torch

from labsrc import rope

D, BASE, L = 40, 10000.0, 1024       # lab-target's head size and base; its trained context


def overshoot(method, x, **kw):
    inv0, _ = rope.rope_frequencies(D, BASE, "default")
    inv, _ = rope.rope_frequencies(D, BASE, method, original_max_position=L, max_position=L, seq_len=x, **kw)
    unturned = 2 * math.pi / inv0 > L
    return float((inv * (x - 1) / (inv0 * (L - 1)))[unturned].max())


@pytest.mark.parametrize("x", [1536, 2048, 4096])
def test_dynamic_ntk_at_a_length_is_static_ntk_with_that_ratio(x):
    dyn, _ = rope.rope_frequencies(D, BASE, "dynamic", original_max_position=L, max_position=L, seq_len=x,
                                   factor=1.0)
    ntk, _ = rope.rope_frequencies(D, BASE, "ntk", original_max_position=L, max_position=L, seq_len=x,
                                   factor=x / L)
    torch.testing.assert_close(dyn, ntk, rtol=1e-6, atol=0)


def test_ntk_overshoots_the_trained_angles_at_its_own_length_and_yarn_does_not():
    assert overshoot("ntk", 4 * L, factor=4.0) > 1.5            # 1.67x past the trained range
    assert overshoot("yarn", 4 * L, factor=4.0) < 1.001         # interpolated by the full factor
    assert overshoot("ntk", 3 * L // 2, factor=4.0) < 1.0       # configured for more: inside the range
    assert 1.0 < overshoot("dynamic", 3 * L // 2, factor=1.0) < overshoot("dynamic", 2 * L, factor=1.0)
