"""The stored curves of the chapters that compare methods, one module per mechanism, each a command.

Each module sweeps its mechanism's methods across the axis where they differ and stores the curve in
``labsrc/data/results/`` with :func:`labsrc.curves.sweep`; its chapter plots the stored curve, writes its prose
from it, and re-scores a slice live. Each module names what the curve depends on (:func:`header`) so that a
test can tell when the stored file is stale.

* :mod:`labsrc.sweeps.rope`: RoPE scaling methods against context length, from the trained length to 4x
  (chapter 4).
* :mod:`labsrc.sweeps.kv_quant`: quantized KV caches against bits, with and without KVarN's normalisation
  (chapter 5).
* :mod:`labsrc.sweeps.kv_eviction`: eviction policies against the KV budget (chapter 6).
* :mod:`labsrc.sweeps.serving`: block-eviction policies in the paged engine against the share of blocks kept
  (chapter 9).

:mod:`labsrc.sweeps.cli` holds what their commands share (common options, loading the model, stamping the
machine on the stored result).
"""
