"""Bench entries ``linear_scan``, ``selective_scan``, ``ssd``: the SSM scans of chapter 7 against PyTorch.

A scan does a handful of flops per element it reads, so all three are judged in GB/s against the HBM
bandwidth (the minimum traffic: every input read once, every output written once; the state never leaves the
chip). ``ssd`` also reports TFLOP/s, since its intra-chunk matrix products make it the one scan with real
tensor-core work. Baselines:

* ``linear_scan`` against the closed form through ``torch.cumprod``/``torch.cumsum``
  (``h_t = P_t * cumsum(b / P)_t`` with ``P = cumprod(a)``): the "cumsum-style" way to scan in PyTorch, fast
  and numerically fragile (``P`` underflows for long sequences; it is timed, not checked);
* ``selective_scan`` against :func:`labsrc.ssm.selective_scan_ref`, a sequential PyTorch loop over the
  sequence (what ``mamba_ssm``'s reference does);
* ``ssd`` against ``transformers``' ``mamba2_chunk_scan`` (the chunked algorithm in PyTorch einsums).

Sizes: ``gpu`` uses Mamba's (d = 2048 and 5120 channels, n = 16) and Mamba-2's (h = 64 and 128 heads of
p = 64, n = 64 and 128) at sequence lengths 1K to 64K; ``tiny`` runs under the interpreter.
"""
from __future__ import annotations

import logging

import torch

from labsrc import runtime, ssm
from labsrc.bench import Case, register
from labsrc.kernels import ssm as K

_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check(got, want, dtype):
    rtol, atol = _TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def _linear_case(rows, l, dtype) -> Case:
    dev = runtime.DEVICE
    gen = torch.Generator().manual_seed(rows + l)
    a = (0.9 + 0.1 * torch.rand(rows, l, generator=gen)).to(dev, dtype)
    b = torch.randn(rows, l, generator=gen).to(dev, dtype)

    def baseline():
        P = torch.cumprod(a.float(), -1)
        return (P * torch.cumsum(b.float() / P, -1)).to(dtype)

    def check():
        n = min(l, 2048)  # the loop reference on a prefix keeps the check quick at 64K
        _check(K.linear_scan(a[:4, :n], b[:4, :n]), ssm.linear_scan_loop(a[:4, :n], b[:4, :n]), dtype)

    return Case(f"rows={rows} l={l} {_dt(dtype)}", kernel=lambda: K.linear_scan(a, b), baseline=baseline,
                check=check, bytes_moved=3 * rows * l * a.element_size(), baseline_name="torch cumprod/cumsum")


def _selective_case(b, d, l, n, dtype) -> Case:
    dev = runtime.DEVICE
    gen = torch.Generator().manual_seed(b * d + l)
    r = lambda *s: torch.randn(*s, generator=gen).to(dev, dtype)  # noqa: E731
    kw = dict(u=r(b, d, l), delta=r(b, d, l) * 0.5, A=(-torch.rand(d, n, generator=gen)).to(dev), B=r(b, n, l),
              C=r(b, n, l), D=torch.randn(d, generator=gen).to(dev), z=r(b, d, l),
              delta_bias=torch.randn(d, generator=gen).to(dev) * 0.3)

    def check():
        dd, ll = min(d, 8), min(l, 1024)
        sub = dict(u=kw["u"][:, :dd, :ll], delta=kw["delta"][:, :dd, :ll], A=kw["A"][:dd], B=kw["B"][..., :ll],
                   C=kw["C"][..., :ll], D=kw["D"][:dd], z=kw["z"][:, :dd, :ll], delta_bias=kw["delta_bias"][:dd])
        _check(K.selective_scan(**sub, delta_softplus=True), ssm.selective_scan_ref(**sub, delta_softplus=True), dtype)

    el = kw["u"].element_size()
    return Case(f"b={b} d={d} l={l} n={n} {_dt(dtype)}",
                kernel=lambda: K.selective_scan(**kw, delta_softplus=True),
                baseline=lambda: ssm.selective_scan_ref(**kw, delta_softplus=True), check=check,
                bytes_moved=(4 * b * d * l + 2 * b * n * l) * el + (d * n + 2 * d) * 4,
                baseline_name="torch loop (selective_scan_ref)")


def _ssd_case(b, l, h, p, g, n, q, dtype) -> Case:
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    logging.getLogger("transformers").setLevel(logging.ERROR)  # its once-only "mamba_ssm not installed" note
    dev = runtime.DEVICE
    gen = torch.Generator().manual_seed(b * l + h)
    r = lambda *s: torch.randn(*s, generator=gen).to(dev, dtype)  # noqa: E731
    x, B, C = r(b, l, h, p), r(b, l, g, n), r(b, l, g, n)
    dt = (torch.rand(b, l, h, generator=gen) * 0.1 + 0.01).to(dev)
    A = (-torch.rand(h, generator=gen) - 0.5).to(dev)
    D = torch.randn(h, generator=gen).to(dev)

    def check():
        ll = min(l, 2048)
        y, s = K.ssd(x[:, :ll], dt[:, :ll], A, B[:, :ll], C[:, :ll], D, chunk_size=q)
        y_ref, s_ref = ssm.ssd_chunked(x[:, :ll], dt[:, :ll], A, B[:, :ll], C[:, :ll], D, chunk_size=q)
        _check(y, y_ref, dtype)
        _check(s, s_ref, torch.float32)

    el = x.element_size()
    chunks = -(-l // q)
    # per chunk and head: C B^T (Q Q N), its product with dt x (Q Q P), C S^T (Q N P), the state update (Q P N)
    flops = 2 * b * h * chunks * (q * q * n + q * q * p + 2 * q * n * p)
    return Case(f"b={b} l={l} h={h} p={p} g={g} n={n} chunk={q} {_dt(dtype)}",
                kernel=lambda: K.ssd(x, dt, A, B, C, D, chunk_size=q),
                baseline=lambda: mamba2_chunk_scan(x, dt, A, B, C, chunk_size=q, D=D),
                check=check, bytes_moved=(2 * b * l * h * p + 2 * b * l * g * n) * el + b * l * h * 4, flops=flops,
                baseline_name="hf mamba2_chunk_scan")


@register("linear_scan")
def linear_entry(size: str) -> list[Case]:
    if size == "gpu":
        return [_linear_case(rows, l, torch.float32) for rows, l in ((4096, 1024), (4096, 8192), (2048, 65536))]
    return [_linear_case(3, 300, torch.float32), _linear_case(2, 77, torch.bfloat16)]


@register("selective_scan")
def selective_entry(size: str) -> list[Case]:
    if size == "gpu":
        shapes = [(1, 2048, 1024, 16), (1, 2048, 8192, 16), (1, 5120, 8192, 16), (1, 2048, 65536, 16)]
        return [_selective_case(*s, torch.bfloat16) for s in shapes]
    return [_selective_case(1, 3, 40, 16, torch.float32), _selective_case(1, 2, 17, 4, torch.bfloat16)]


@register("ssd")
def ssd_entry(size: str) -> list[Case]:
    if size == "gpu":
        # chunks of 32: the kernel's tiles fit in registers at 32 steps, not 64 (labsrc.kernels.ssm._ssd_configs)
        shapes = [(1, 1024, 64, 64, 1, 128, 32), (1, 8192, 64, 64, 1, 128, 32), (1, 8192, 128, 64, 8, 64, 32),
                  (1, 65536, 64, 64, 1, 128, 32)]
        return [_ssd_case(*s, torch.bfloat16) for s in shapes]
    return [_ssd_case(1, 70, 2, 16, 1, 16, 32, torch.float32), _ssd_case(1, 33, 4, 8, 2, 16, 16, torch.bfloat16)]
