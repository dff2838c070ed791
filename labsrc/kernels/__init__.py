"""Triton kernels of the lab, one module per family (``labsrc.kernels.kv_cache`` ...).

Each module holds the Triton kernel, its validating Python wrapper and a plain PyTorch reference named
``<name>_ref``. Import :mod:`labsrc` before ``triton`` so that, without a GPU, the kernels run in Triton's
interpreter; importing this package does that for you.
"""
import labsrc  # noqa: F401  (sets TRITON_INTERPRET before any kernel module imports triton)
