"""A small serving engine for the lab's models: paged KV cache, paged attention, continuous batching, prefix
caching, preemption, and an OpenAI-compatible HTTP server (chapter 9).

* :mod:`labsrc.serving.blocks` -- :class:`BlockManager`: blocks, tables, reference counts, copy-on-write,
  prefix caching;
* :mod:`labsrc.serving.scheduler` -- :class:`Scheduler`: token budget, chunked prefill, FCFS, preemption;
* :mod:`labsrc.serving.engine` -- :class:`Engine`: the paged cache inside a ``transformers`` Llama;
* :mod:`labsrc.serving.server` -- ``python -m labsrc.serving``: ``/v1/completions`` over HTTP, with the request
  it accepts in :mod:`labsrc.serving.protocol` and streamed text from :mod:`labsrc.serving.detokenizer`;
* :mod:`labsrc.serving.bench` -- ``python -m labsrc.serving.bench``: replay a trace against the server, or
  (``--compare``) time the engine against ``transformers`` in one process.
"""
from labsrc.serving.blocks import BlockManager, NoFreeBlocksError, block_hashes, slot_mapping, slot_of
from labsrc.serving.scheduler import SamplingParams, Scheduler, Sequence

__all__ = ["BlockManager", "NoFreeBlocksError", "block_hashes", "slot_mapping", "slot_of", "SamplingParams",
           "Scheduler", "Sequence", "Engine"]


def __getattr__(name):
    if name == "Engine":  # imports transformers and the kernels: only when asked for
        from labsrc.serving.engine import Engine
        return Engine
    raise AttributeError(name)
