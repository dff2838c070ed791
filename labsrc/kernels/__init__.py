"""Triton kernels of the lab, one module or package per chapter, named for it (``labsrc.kernels.kv_cache`` ...).

Each holds the Triton kernels, their validating Python wrappers and the plain PyTorch references (``<name>_ref``)
and formats they are checked against, beside the fast op as in flash-linear-attention (a family past 800 lines
is a package: ``flash_attention/naive.py`` beside ``forward.py``, ``backward.py``, ``decode.py``). Imports run
down only: a kernel module imports the runtime and other kernel modules, never a chapter's mechanism module. Import :mod:`labsrc` before ``triton`` so that, without a GPU, the kernels run in Triton's
interpreter; importing this package does that for you.
"""
import labsrc  # noqa: F401  (sets TRITON_INTERPRET before any kernel module imports triton)
