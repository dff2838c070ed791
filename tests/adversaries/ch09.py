"""Chapter 9's exercises against wrong answers (see tests/adversarial.py)."""
from tests.adversarial import Adversary, Exercise, bypass, constants, handed_out, scaled, silent_kernel, visible_only


def _setup():
    from labsrc.serving import BlockManager, block_hashes, slot_mapping
    return {"block_hashes": block_hashes, "BlockManager": BlockManager, "slot_mapping": slot_mapping}


def _always(verdict):
    return Adversary(f"constant {verdict}", lambda right: lambda *a: verdict)


def _visible_verdicts_only():
    """Right on the visible queues (learned from a run of the visible check), the opposite verdict elsewhere:
    the framework's visible_only leaves a bool as it is, so admission needs its own."""
    def build(right):
        seen = set()

        def answer(*args):
            if answer.learning:
                seen.add(args)
                return right(*args)
            return right(*args) if args in seen else not right(*args)
        answer.learning = True
        return answer
    return Adversary("right on the visible cases only", build, hidden_only=True)


def _library_slots(right):
    from labsrc.serving import slot_mapping
    return lambda table, start, end, bs: slot_mapping(table, start, end, bs)


def _run_the_manager(right):
    """Fork and append on a BlockManager (the measurement the check makes): refused."""
    def answer(prompt_len, n, new_tokens, block_size):
        from labsrc.serving import BlockManager
        bm = BlockManager(num_blocks=n * (prompt_len + new_tokens) + 4, block_size=block_size)
        bm.allocate(0, list(range(prompt_len)))
        for child in range(1, n):
            bm.fork(0, child)
        for _ in range(new_tokens):
            for s in range(n):
                bm.append_slot(s, 1)
        tables = {b for s in range(n) for b in bm.block_table(s)}
        return len(tables), len(bm.take_copies())
    return answer


def _allocate_on_a_manager(right):
    def answer(prompt, published, block_size):
        from labsrc.serving import BlockManager
        bm = BlockManager(num_blocks=len(prompt) + 4, block_size=block_size)
        return bm.allocate("q", prompt)
    return answer



def _kernel_setup():
    from labsrc.runtime import HAS_TRITON
    return {"HAS_TRITON": HAS_TRITON}


CH = "09_serving"
EXERCISES = [
    Exercise(CH, "check_slot_mapping", [*constants(), *scaled(), visible_only(),
                                        bypass("labsrc.serving.slot_mapping", _library_slots)]),
    Exercise(CH, "check_fork_blocks", [*constants(), *scaled(), visible_only(),
                                       bypass("a BlockManager run in the answer", _run_the_manager)]),
    Exercise(CH, "check_admission", [_always(True), _always(False), _visible_verdicts_only(),
                                     handed_out(CH, "admits")]),
    Exercise(CH, "check_cached_prefix",
             [*constants(), *scaled(), visible_only(), handed_out(CH, "cached_tokens_buggy", _setup()),
              bypass("the block manager's allocate", _allocate_on_a_manager)],
             setup=_setup()),
    Exercise(CH, "check_packed_gather_kernel", [silent_kernel()], setup=_kernel_setup()),
]
