"""The block manager: fixed-size KV blocks, block tables, reference counts, copy-on-write and prefix caching.

A paged KV cache (PagedAttention, {cite}`kwon2023paged`) stores the keys and values of every
sequence in fixed-size *blocks* of ``block_size`` token slots taken from one shared pool. A sequence owns a
*block table*: the list of the blocks that hold its tokens, in order. Token ``p`` of a sequence lives in slot
``table[p // block_size] * block_size + p % block_size`` of the pool (:func:`slot_of`). A sequence of ``n``
tokens holds ``ceil(n / block_size)`` blocks, so at most ``block_size - 1`` slots per sequence are wasted,
instead of the ``max_len - n`` that reserving the maximum length wastes.

What this module keeps, and nothing else (the K/V tensors live in the engine's pools):

* a reference count per block: how many block tables name it. ``fork(parent, child)`` shares every block of
  the parent (count + 1); a write into a block named by more than one table first copies it
  (*copy-on-write*): the writer gets a fresh block, and the engine copies the old block's K/V into it
  (:meth:`BlockManager.take_copies`);
* prefix caching: a full block is identified by a hash *chain* over the tokens of every block up to and
  including it, ``h_i = SHA-256(h_{i-1} || tokens of block i)``, so two equal blocks at different prefixes
  never share an id. The hash is cryptographic because a request chooses its own tokens: with a weak hash
  (Python's ``hash``, which vLLM used until it moved to SHA-256) a client can build a prefix whose chain
  hash equals another prompt's and be served K/V computed after someone else's prefix. Once its K/V is computed (:meth:`BlockManager.mark_computed`) a full block is published
  under its hash; a later request whose prompt starts with the same blocks reuses them instead of computing
  them again;
* an LRU pool of freed cached blocks: a block whose count falls to 0 keeps its K/V and its hash until the
  pool needs a block and nothing is free; a request that arrives before then revives it.

Running out of blocks raises :class:`NoFreeBlocksError` *before* any table or count is changed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

__all__ = ["BlockManager", "NoFreeBlocksError", "block_hashes", "chain_hash", "slot_of", "slot_mapping"]


class NoFreeBlocksError(RuntimeError):
    """The pool has no free (or evictable cached) block left for the request."""


def chain_hash(parent: bytes | None, block_tokens) -> bytes:
    """One link of the chain: ``SHA-256(parent || tokens)``, 32 bytes. The parent digest has a fixed length and
    the tokens are written as comma-separated decimals, so two different (parent, tokens) pairs never give the
    same input, and finding two that give the same digest is as hard as breaking SHA-256."""
    text = ",".join(str(int(t)) for t in block_tokens).encode()
    return hashlib.sha256((parent or b"") + text).digest()


def block_hashes(token_ids, block_size: int) -> list[bytes]:
    """The hash chain of the *full* blocks of ``token_ids``: ``h_i = SHA-256(h_{i-1} || tokens of block i)``.

    Chaining makes a block's hash depend on everything before it: the same 16 tokens after two different
    prefixes give two different hashes, so their K/V (which depends on the prefix) are never confused. A
    cryptographic hash makes it infeasible to *choose* tokens whose chain collides with another prompt's (the
    block manager also compares a hit's own tokens, which alone would not catch a forged parent).
    """
    hashes, prev = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, token_ids[start:start + block_size])
        hashes.append(prev)
    return hashes


def slot_of(block_table, position: int, block_size: int) -> int:
    """The pool slot that holds token ``position`` of a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table, start: int, end: int, block_size: int) -> list[int]:
    """The slots of tokens ``start .. end - 1`` of a sequence: where their new K/V are written."""
    return [slot_of(block_table, p, block_size) for p in range(start, end)]


@dataclass
class _Seq:
    table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token that has a slot
    hashes: list[bytes] = field(default_factory=list)  # hash chain of the full blocks so far
    computed: int = 0  # tokens whose K/V is known to be written (published blocks lie below this)
    evicted: bool = False  # blocks were dropped: the table no longer spells a prefix, publish nothing


class BlockManager:
    """Allocate fixed-size KV blocks to sequences (see the module docstring).

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
        block_size: token slots per block.
        enable_prefix_caching: publish computed full blocks under their hash chain and reuse them.

    Counters: :attr:`num_free_blocks` (free plus evictable cached blocks: what a new request can take),
    ``cache_queries`` and ``cache_hits`` (full prompt blocks looked up / found at allocation).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks  # the published hash of a block, if any
        self.block_tokens: list[tuple | None] = [None] * num_blocks  # its tokens, to verify a hit
        self._free: deque[int] = deque(range(num_blocks))  # no owner, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # no owner, cached; oldest first (LRU)
        self._cached: dict[bytes, int] = {}  # hash -> block id (owned or evictable)
        self._seqs: dict = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) K/V copies owed by copy-on-write
        self.cache_queries = 0
        self.cache_hits = 0

    # ------------------------------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take now: never-used or freed blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Published blocks (owned or evictable)."""
        return len(self._cached)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id).tokens)

    def _seq(self, seq_id) -> _Seq:
        if seq_id not in self._seqs:
            raise KeyError(f"unknown sequence {seq_id!r}: allocate it first")
        return self._seqs[seq_id]

    def _hits(self, token_ids, hashes, use_cache: bool = True) -> list[int]:
        """Blocks of the published prefix of ``token_ids``, stopping at the first miss.

        At least one token is always left to compute (the model needs the last prompt token's logits), so a
        prompt made of whole cached blocks reuses all but its last block.
        """
        if not (self.enable_prefix_caching and use_cache):
            return []
        hits = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self._cached.get(h)
            if block is None or self.block_tokens[block] != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        if hits and len(hits) * bs >= len(token_ids):
            hits.pop()
        return hits

    def _blocks_needed(self, token_ids, use_cache: bool = True) -> tuple[list[int], int]:
        hashes = block_hashes(token_ids, self.block_size)
        hits = self._hits(token_ids, hashes, use_cache)
        # A hit on an owned block costs nothing; a hit on an evictable block takes it out of the pool.
        fresh = math.ceil(len(token_ids) / self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return hits, fresh + revived

    def can_allocate(self, token_ids, use_cache: bool = True) -> bool:
        """Whether :meth:`allocate` of these tokens would find enough blocks now."""
        return self._blocks_needed(list(token_ids), use_cache)[1] <= self.num_free_blocks

    def can_append(self, seq_id) -> bool:
        """Whether :meth:`append_slot` would find a block now (it needs one when the last block is full or
        shared)."""
        s = self._seq(seq_id)
        needs = len(s.tokens) % self.block_size == 0 or self.ref_count[s.table[-1]] > 1
        return not needs or self.num_free_blocks >= 1

    # ------------------------------------------------------------------------------------------ changes
    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)  # least recently freed
            del self._cached[self.block_hash[block]]
            self.block_hash[block] = self.block_tokens[block] = None
        else:
            raise NoFreeBlocksError("no free KV block left")  # callers check first; this is a guard
        self.ref_count[block] = 1
        return block

    def allocate(self, seq_id, token_ids, use_cache: bool = True) -> int:
        """Give a new sequence blocks for ``token_ids``; return how many leading tokens are already cached.

        Cached tokens (whole published blocks of the same prefix) need no prefill: their K/V is in the pool.
        ``use_cache=False`` takes fresh blocks for everything (a request that wants every prompt token's logits).
        Raises :class:`NoFreeBlocksError` (nothing changed) when the pool cannot hold the sequence.
        """
        token_ids = [int(t) for t in token_ids]
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError("token_ids must hold at least one token")
        hits, needed = self._blocks_needed(token_ids, use_cache)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {needed} free blocks for {len(token_ids)} tokens "
                                    f"but the pool has {self.num_free_blocks} of {self.num_blocks}")
        self.cache_queries += len(token_ids) // self.block_size
        self.cache_hits += len(hits)
        table = []
        for block in hits:
            if self.ref_count[block] == 0:
                del self._evictable[block]  # revived
            self.ref_count[block] += 1
            table.append(block)
        for _ in range(math.ceil(len(token_ids) / self.block_size) - len(hits)):
            table.append(self._take_block())
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Seq(table, token_ids, block_hashes(token_ids, self.block_size), cached)
        return cached

    def append_slot(self, seq_id, token_id) -> int:
        """Give one more token of a sequence a slot, and return that slot.

        A new block when the last one is full; a private copy of the last block when it is shared with a fork
        (copy-on-write: the (src, dst) pair is queued for :meth:`take_copies`, and the engine must copy the
        K/V before it writes the new token). Raises :class:`NoFreeBlocksError` (nothing changed) when a block
        is needed and none is free.
        """
        s = self._seq(seq_id)
        bs = self.block_size
        pos = len(s.tokens)
        if pos % bs == 0:
            if self.num_free_blocks < 1:
                raise NoFreeBlocksError(f"sequence {seq_id!r} needs a new block at token {pos}; the pool is full")
            s.table.append(self._take_block())
        elif self.ref_count[s.table[-1]] > 1:
            if self.num_free_blocks < 1:
                raise NoFreeBlocksError(f"sequence {seq_id!r} must copy its shared last block before writing "
                                        "into it, and the pool is full")
            old = s.table[-1]
            new = self._take_block()
            self.ref_count[old] -= 1
            s.table[-1] = new
            self._copies.append((old, new))
        s.tokens.append(int(token_id))
        if len(s.tokens) % bs == 0 and not s.evicted:
            s.hashes.append(chain_hash(s.hashes[-1] if s.hashes else None, s.tokens[-bs:]))
        return slot_of(s.table, pos, bs)

    def mark_computed(self, seq_id, num_computed: int) -> None:
        """Record that the K/V of the first ``num_computed`` tokens is written, and publish the full blocks
        among them for prefix caching (a block is never shared before its K/V exists)."""
        s = self._seq(seq_id)
        if not 0 <= num_computed <= len(s.tokens):
            raise ValueError(f"num_computed must lie in [0, {len(s.tokens)}], got {num_computed}")
        if self.enable_prefix_caching and not s.evicted:
            for i in range(s.computed // self.block_size, num_computed // self.block_size):
                block, h = s.table[i], s.hashes[i]
                if self.block_hash[block] is None and h not in self._cached:
                    self.block_hash[block] = h
                    self.block_tokens[block] = tuple(s.tokens[i * self.block_size:(i + 1) * self.block_size])
                    self._cached[h] = block
        s.computed = max(s.computed, num_computed)

    def drop_blocks(self, seq_id, indices) -> list[int]:
        """Evict whole blocks from a sequence: remove entries ``indices`` of its table (full blocks, never the
        last) and release them; return the block ids. The sequence's cache then holds fewer tokens than it
        has seen: it stops publishing blocks for prefix caching, since its table no longer spells a prefix.
        (A block another table still names stays with that table; a cached block goes to the LRU pool.)"""
        s = self._seq(seq_id)
        idx = sorted({int(i) for i in indices})
        if idx and (idx[0] < 0 or idx[-1] >= len(s.table) - 1):
            raise ValueError(f"indices must name blocks 0..{len(s.table) - 2} (never the last), got {idx}")
        bs = self.block_size
        dropped = []
        for i in reversed(idx):
            block = s.table.pop(i)
            del s.tokens[i * bs:(i + 1) * bs]
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
            dropped.append(block)
        if idx:
            s.evicted = True
            s.hashes = []
            s.computed = min(s.computed, len(s.tokens))
        return sorted(dropped)

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares every block (no K/V is copied now)."""
        p = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        for block in p.table:
            self.ref_count[block] += 1
        # Every field is copied, ``evicted`` included: a child of a parent that dropped blocks must not publish
        # its blocks either (its hash list is empty, so it would index past it, or hash a table with holes).
        self._seqs[child_id] = dataclasses.replace(p, table=list(p.table), tokens=list(p.tokens),
                                                   hashes=list(p.hashes))

    def free(self, seq_id) -> None:
        """Release a sequence's blocks. A block nobody else holds becomes free, or evictable if it is cached
        (its K/V stays for a later prefix hit). The tail goes first into the LRU, so it is evicted first."""
        s = self._seq(seq_id)
        for block in reversed(s.table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        del self._seqs[seq_id]

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies owed by copy-on-write since the last call (the engine copies the K/V)."""
        copies, self._copies = self._copies, []
        return copies

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the books do not balance (used by the tests after every operation)."""
        uses = [0] * self.num_blocks
        for s in self._seqs.values():
            assert len(s.table) == math.ceil(len(s.tokens) / self.block_size), "table length != ceil(n / bs)"
            for b in s.table:
                uses[b] += 1
        assert uses == self.ref_count, "reference counts differ from the uses in block tables"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable, "a block is listed twice"
        for b in range(self.num_blocks):
            if self.ref_count[b] == 0:
                assert (b in free) != (b in evictable), f"block {b} is unowned but neither free nor evictable"
                assert (b in evictable) == (self.block_hash[b] is not None), f"block {b}: evictable iff cached"
            else:
                assert b not in free and b not in evictable, f"owned block {b} is in a free list"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, "hash table and block hashes disagree"
