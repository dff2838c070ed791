"""Chapter 14's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import (Adversary, Exercise, base_namespace, bypass, cells_of, constants, scaled,
                               silent_kernel, visible_only)


def _setup():
    from labsrc import memory
    return {"memory": memory}


def _buggy_chunks(right):
    """The handed-out chunker, which sits in the solution cell above fixed_chunks (so the framework's
    ``handed_out``, which reads markdown blocks and cells without a solution, cannot reach it)."""
    solution, _ = cells_of(CH, "check_fixed_chunks")
    ns = base_namespace()
    exec(compile(solution.split("def fixed_chunks")[0], f"<{CH} handout buggy_chunks>", "exec"), ns)
    return ns["buggy_chunks"]


def _simulated_recall(right):
    """A Monte Carlo of the sharded search (the chapter's measure_sharded_recall) instead of the expectation."""
    def answer(k, shards, per_shard):
        import torch
        g = torch.Generator().manual_seed(0)
        scores = torch.randn(400, 256, generator=g)
        shard = torch.randint(0, shards, (400, 256), generator=g)
        truth = scores.topk(k, 1).indices
        kept = 0
        for row in range(400):
            order = scores[row].argsort(descending=True)
            seen = [0] * shards
            for rank, idx in enumerate(order[:k].tolist()):
                s = int(shard[row, idx])
                kept += seen[s] < per_shard
                seen[s] += 1
        return kept / truth.numel()
    return answer


def _library_merge(right):
    def answer(k, shards, per_shard):
        from labsrc import memory
        return memory.recall_at_k(memory.topk_merge, k)
    return answer


def _library_chunks(right):
    def answer(n, size, overlap):
        from labsrc import memory
        return memory.chunk_spans(n, size, overlap)
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "14_memory_retrieval"
EXERCISES = [
    Exercise(CH, "check_sharded_recall", [*constants(), *scaled(), visible_only(),
                                          bypass("a Monte Carlo of the search", _simulated_recall),
                                          bypass("labsrc.memory's merge and recall", _library_merge)]),
    Exercise(CH, "check_smallest_nprobe", [*constants(), *scaled(), visible_only()], setup=_setup()),
    Exercise(CH, "check_fixed_chunks",
             [*constants(), *scaled(), visible_only(), Adversary("the handed-out buggy_chunks", _buggy_chunks),
              bypass("labsrc.memory.chunk_spans", _library_chunks)]),
    Exercise(CH, "check_gathered_rows_kernel", [silent_kernel()], setup=_kernel_setup()),
]
