"""The kernel bench: every Triton kernel of `labsrc` timed against PyTorch. Run `python -m kernels.bench`."""
