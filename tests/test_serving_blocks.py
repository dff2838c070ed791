"""The block manager: unit cases, and a property-based fuzz of random allocate/append/fork/free/prefix-hit runs
against a model of the pool's contents (what each slot holds), checking the books after every operation."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from labsrc.serving.blocks import BlockManager, NoFreeBlocksError, block_hashes, slot_mapping, slot_of


def test_allocation_takes_ceil_blocks_and_maps_slots():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", list(range(9))) == 0
    table = bm.block_table("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 5
    assert slot_of(table, 5, 4) == table[1] * 4 + 1
    assert slot_mapping(table, 7, 9, 4) == [table[1] * 4 + 3, table[2] * 4]
    bm.check_invariants()


def test_append_opens_a_block_only_when_the_last_is_full():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1, 2, 3])
    assert bm.append_slot("a", 4) == bm.block_table("a")[0] * 4 + 3
    assert bm.num_free_blocks == 3
    bm.append_slot("a", 5)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 2
    bm.check_invariants()


def test_fork_shares_then_copies_on_write():
    bm = BlockManager(8, 4)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])  # one full block, one partly filled
    bm.fork("p", "c")
    assert bm.block_table("p") == bm.block_table("c")
    assert bm.ref_count[bm.block_table("p")[1]] == 2
    shared_last = bm.block_table("p")[1]
    bm.append_slot("c", 7)  # writes into the shared partial block: the child gets its own copy first
    assert bm.take_copies() == [(shared_last, bm.block_table("c")[1])]
    assert bm.block_table("c")[0] == bm.block_table("p")[0] and bm.block_table("c")[1] != shared_last
    bm.append_slot("p", 8)  # the parent is now the only owner: no copy
    assert bm.take_copies() == [] and bm.block_table("p")[1] == shared_last
    bm.check_invariants()
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_cache_hits_after_compute_and_revives_freed_blocks():
    bm = BlockManager(8, 4)
    prompt = list(range(10))  # two full blocks and two tokens
    assert bm.allocate("a", prompt) == 0
    assert bm.allocate("b", prompt) == 0  # "a" is not computed yet: nothing is published
    bm.mark_computed("a", 10)
    assert bm.num_cached_blocks == 2
    assert bm.allocate("c", prompt + [99]) == 8  # both full blocks reused
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]
    bm.free("a"), bm.free("c")
    assert bm.ref_count[bm.block_table("b")[0]] == 1
    freed = bm.num_free_blocks
    assert bm.allocate("d", prompt) == 8  # revived from the evictable pool
    assert bm.num_free_blocks == freed - 3  # two revived from the pool, one new block
    assert bm.cache_hits == 4 and bm.cache_queries == 8
    bm.check_invariants()


def test_whole_block_prompt_leaves_its_last_block_to_compute():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(8)))
    bm.mark_computed("a", 8)
    assert bm.allocate("b", list(range(8))) == 4  # the model needs the last token's logits


def test_equal_blocks_at_different_prefixes_do_not_collide():
    assert block_hashes([1, 2, 7, 7], 2)[1] != block_hashes([3, 4, 7, 7], 2)[1]
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2, 7, 7, 5])
    bm.mark_computed("a", 5)
    assert bm.allocate("b", [3, 4, 7, 7, 5]) == 0


def test_running_out_raises_and_changes_nothing():
    bm = BlockManager(3, 4)
    bm.allocate("a", list(range(8)))
    before = (bm.block_table("a"), list(bm.ref_count), bm.num_free_blocks)
    assert not bm.can_allocate(list(range(100, 108)))
    with pytest.raises(NoFreeBlocksError, match="needs 2 free blocks"):
        bm.allocate("b", list(range(100, 108)))
    assert "b" not in bm and (bm.block_table("a"), list(bm.ref_count), bm.num_free_blocks) == before
    bm.allocate("c", [1])
    assert not bm.can_append("a")
    with pytest.raises(NoFreeBlocksError, match="pool is full"):
        bm.append_slot("a", 9)
    assert bm.num_tokens("a") == 8
    bm.check_invariants()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(TypeError, match="block_size"):
        BlockManager(4, 2.0)
    bm = BlockManager(4, 4)
    with pytest.raises(KeyError, match="unknown sequence"):
        bm.block_table("x")
    with pytest.raises(ValueError, match="at least one token"):
        bm.allocate("x", [])
    bm.allocate("x", [1])
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("x", [2])
    with pytest.raises(ValueError, match="num_computed"):
        bm.mark_computed("x", 2)


class PoolModel:
    """What the K/V pool would hold: slot -> the full prefix of tokens whose K/V was written there (K/V at a
    position depends on every token before it, so a wrong reuse shows up as a different prefix)."""

    def __init__(self, bm):
        self.bm, self.slots, self.seqs = bm, {}, {}

    def write(self, seq, start, end):
        bs, table, tokens = self.bm.block_size, self.bm.block_table(seq), self.seqs[seq]
        for p in range(start, end):
            block = table[p // bs]
            assert self.bm.ref_count[block] == 1, "a write into a shared block without copy-on-write"
            self.slots[slot_of(table, p, bs)] = tuple(tokens[:p + 1])

    def copy(self):
        bs = self.bm.block_size
        for src, dst in self.bm.take_copies():
            for i in range(bs):
                if src * bs + i in self.slots:
                    self.slots[dst * bs + i] = self.slots[src * bs + i]

    def check(self, seq):
        table, tokens = self.bm.block_table(seq), self.seqs[seq]
        for p in range(len(tokens)):
            assert self.slots.get(slot_of(table, p, self.bm.block_size)) == tuple(tokens[:p + 1]), \
                f"sequence {seq} reads wrong K/V at position {p}"


def run_ops(seed, n_ops, num_blocks, block_size, prefix_caching):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    model = PoolModel(bm)
    # A few shared system prompts, so that prefix hits happen often.
    systems = [[rng.randrange(4) for _ in range(rng.randrange(1, 3 * block_size))] for _ in range(3)]
    next_id = 0
    for _ in range(n_ops):
        op = rng.random()
        live = list(model.seqs)
        if op < 0.35 or not live:
            tokens = rng.choice(systems) + [rng.randrange(4) for _ in range(rng.randrange(0, 2 * block_size))]
            tokens = tokens or [0]
            fits = bm.can_allocate(tokens)
            try:
                cached = bm.allocate(next_id, tokens)
            except NoFreeBlocksError:
                assert not fits
                continue
            assert fits
            model.seqs[next_id] = tokens
            # The cached prefix must already hold this prompt's K/V; the rest is written now.
            for p in range(cached):
                assert model.slots.get(slot_of(bm.block_table(next_id), p, block_size)) == tuple(tokens[:p + 1])
            model.write(next_id, cached, len(tokens))
            bm.mark_computed(next_id, len(tokens))
            next_id += 1
        elif op < 0.7:
            seq = rng.choice(live)
            token = rng.randrange(4)
            fits = bm.can_append(seq)
            try:
                bm.append_slot(seq, token)
            except NoFreeBlocksError:
                assert not fits
                continue
            assert fits
            model.seqs[seq] = model.seqs[seq] + [token]
            model.copy()
            n = len(model.seqs[seq])
            model.write(seq, n - 1, n)
            bm.mark_computed(seq, n)
        elif op < 0.8:
            parent = rng.choice(live)
            bm.fork(parent, next_id)
            model.seqs[next_id] = list(model.seqs[parent])
            next_id += 1
        else:
            seq = rng.choice(live)
            bm.free(seq)
            del model.seqs[seq]
        bm.check_invariants()
        for seq in model.seqs:
            model.check(seq)
    for seq in list(model.seqs):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks and all(c == 0 for c in bm.ref_count)
    return bm


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 16]),
       prefix_caching=st.booleans())
def test_fuzz_block_manager_against_a_model_of_the_pool(seed, num_blocks, block_size, prefix_caching):
    run_ops(seed, 150, num_blocks, block_size, prefix_caching)


def test_fuzz_hits_the_prefix_cache_and_runs_out():
    bm = run_ops(7, 600, 12, 2, True)
    assert bm.cache_hits > 0


def test_dropping_blocks_frees_them_and_stops_publishing():
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2, 3, 4, 5, 6, 7])  # 4 blocks, the last partly filled
    bm.mark_computed("a", 7)
    table = bm.block_table("a")
    assert bm.drop_blocks("a", [1, 2]) == sorted(table[1:3])
    assert bm.block_table("a") == [table[0], table[3]] and bm.num_tokens("a") == 3
    assert bm.num_free_blocks == 6  # the two dropped blocks were published: evictable, still cached
    bm.append_slot("a", 8)
    bm.append_slot("a", 9)
    bm.mark_computed("a", 5)
    assert bm.num_cached_blocks == 3  # nothing new published from an evicted table
    bm.check_invariants()
    with pytest.raises(ValueError, match="never the last"):
        bm.drop_blocks("a", [2])


def test_block_hashes_are_a_sha256_chain():
    """The chain is SHA-256 of (parent digest, block tokens), checked against hashlib directly: a hash a client
    cannot steer (Python's ``hash`` of a tuple can be inverted to forge a prefix whose chain equals another's)."""
    import hashlib

    tokens = [5, 17, 300, 2, 9, 9, 4096, 1, 7]
    want, prev = [], b""
    for i in range(0, 8, 4):
        prev = hashlib.sha256(prev + ",".join(map(str, tokens[i:i + 4])).encode()).digest()
        want.append(prev)
    assert block_hashes(tokens, 4) == want
    # the parent is part of the input: equal blocks after different parents differ, and so do token boundaries
    assert block_hashes([1, 2, 7, 7], 2)[1] != block_hashes([3, 4, 7, 7], 2)[1]
    assert block_hashes([1, 23], 2) != block_hashes([12, 3], 2)


def test_fork_after_drop_blocks_publishes_nothing():
    """A fork of a sequence that dropped blocks used to lose the 'evicted' mark: marking it computed indexed past
    its empty hash list, and a later full block was published under a hash of a table with holes."""
    bm = BlockManager(16, 2)
    bm.allocate("a", list(range(9)))
    bm.mark_computed("a", 9)
    cached = bm.num_cached_blocks
    bm.drop_blocks("a", [1, 2])
    bm.fork("a", "b")
    for t in (50, 51, 52, 53):
        bm.append_slot("b", t)
        bm.mark_computed("b", bm.num_tokens("b"))
        bm.check_invariants()
    assert bm.num_cached_blocks == cached  # nothing new published by the holed child
    # a fresh prompt equal to the child's surviving tokens must not hit anything the child wrote
    assert bm.allocate("c", [0, 1, 6, 7, 8, 50, 51, 52, 53]) == 2  # only block 0 is a true prefix
    bm.free("a"), bm.free("b"), bm.free("c")
    bm.check_invariants()
