"""Eviction at page granularity with lazy release: tokens are dropped one by one, pages go back to the pool
when they empty.
"""
from __future__ import annotations

import torch

from labsrc.kv_eviction.scores import _nonneg_int, stochastic_keep, topk_keep


# --------------------------------------------------------------------------------------------------
# Page granularity with lazy release
# --------------------------------------------------------------------------------------------------

class PagedEvictionPool:
    """A pool of ``num_pages`` physical pages of ``page_size`` token slots shared by sequences, with
    eviction at page granularity and lazy release.

    * :meth:`append` gives each new token a slot, taking a new page when the sequence's last page is full.
    * :meth:`evict` scores a sequence's pages (mean of its tokens' scores), keeps pages with probability
      proportional to score (:func:`stochastic_keep`, or top-K) and *marks* the others. Pages holding a
      protected token (the first ``protect`` positions: a system prompt) and the page being written are
      never marked. A marked page leaves the sequence's page table at once (attention stops reading it),
      but its data stays until the page is needed again.
    * When a new page is needed, a free page is used first, then the oldest marked page (only now is it
      released: lazy release). :meth:`restore` puts a marked page back if it has not been reused yet, at
      no recomputation cost.
    """

    def __init__(self, num_pages: int, page_size: int = 16, protect: int = 0):
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_pages, self.page_size = num_pages, page_size
        self.protect = _nonneg_int("protect", protect)
        self.free: list[int] = list(range(num_pages))
        self.marked: dict[int, tuple] = {}          # page -> (seq_id, logical index, start position), in mark order
        self.tables: dict = {}                      # seq_id -> list of [page, start position, filled]
        self.lengths: dict = {}                     # seq_id -> tokens appended so far
        self.reused = 0

    def pages(self, seq_id) -> list[int]:
        """The physical pages the sequence's attention reads, in position order."""
        return [entry[0] for entry in self.tables.get(seq_id, [])]

    def page_positions(self, seq_id) -> list[range]:
        """The token positions held by each of the sequence's pages."""
        return [range(start, start + filled) for _, start, filled in self.tables.get(seq_id, [])]

    @property
    def n_free(self) -> int:
        """Pages available for a new allocation (free plus marked)."""
        return len(self.free) + len(self.marked)

    def _allocate(self) -> int:
        if self.free:
            return self.free.pop(0)
        if self.marked:
            page = next(iter(self.marked))          # oldest mark first
            del self.marked[page]
            self.reused += 1
            return page
        raise MemoryError("no free or marked page left: evict pages first")

    def append(self, seq_id, n_tokens: int = 1) -> list[tuple[int, int]]:
        """Give ``n_tokens`` new tokens of ``seq_id`` their (page, slot); raises MemoryError (appending
        nothing) when they do not fit."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
        table = self.tables.get(seq_id, [])
        length = self.lengths.get(seq_id, 0)
        room = 0
        if table and table[-1][1] + table[-1][2] == length:
            room = self.page_size - table[-1][2]
        if room + self.page_size * self.n_free < n_tokens:
            raise MemoryError(f"no free or marked page left for {n_tokens} tokens: evict pages first")
        table = self.tables.setdefault(seq_id, table)
        slots = []
        for _ in range(n_tokens):
            if not table or table[-1][2] == self.page_size or table[-1][1] + table[-1][2] != length:
                table.append([self._allocate(), length, 0])
            entry = table[-1]
            slots.append((entry[0], entry[2]))
            entry[2] += 1
            length += 1
            self.lengths[seq_id] = length
        return slots

    def page_scores(self, seq_id, token_scores: torch.Tensor) -> torch.Tensor:
        """Mean token score of each page; ``token_scores`` is indexed by position (length = tokens appended)."""
        if not isinstance(token_scores, torch.Tensor):
            raise ValueError(f"token_scores must be a torch.Tensor, got {type(token_scores).__name__}")
        if token_scores.dim() != 1 or token_scores.numel() != self.lengths.get(seq_id, 0):
            raise ValueError(f"token_scores must be 1-D with one score per appended token "
                             f"({self.lengths.get(seq_id, 0)}), got shape {tuple(token_scores.shape)}")
        return torch.stack([token_scores[start:start + filled].float().mean()
                            for _, start, filled in self.tables[seq_id]])

    def evictable(self, seq_id) -> torch.Tensor:
        """Boolean mask over the sequence's pages: False for protected pages and the page being written."""
        table = self.tables.get(seq_id, [])
        mask = torch.tensor([start >= self.protect for _, start, _ in table], dtype=torch.bool)
        if table:
            mask[-1] = False
        return mask

    def evict(self, seq_id, token_scores: torch.Tensor, n_pages: int, stochastic: bool = True,
              generator: torch.Generator | None = None) -> list[int]:
        """Mark ``n_pages`` of the sequence's evictable pages, chosen by page score; returns them."""
        scores = self.page_scores(seq_id, token_scores)
        cand = torch.nonzero(self.evictable(seq_id)).flatten()
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or not 0 < n_pages <= cand.numel():
            raise ValueError(f"n_pages must be an int in [1, {cand.numel()}] (evictable pages), got {n_pages!r}")
        keep_n = cand.numel() - n_pages
        drop = torch.ones(cand.numel(), dtype=torch.bool)
        if keep_n > 0:
            s = scores[cand].clamp_min(1e-12)
            kept = stochastic_keep(s, keep_n, generator) if stochastic else topk_keep(s, keep_n)
            drop[kept] = False
        victims = sorted(int(i) for i in cand[drop])
        table = self.tables[seq_id]
        pages = []
        for logical in reversed(victims):
            page, start, filled = table.pop(logical)
            self.marked[page] = (seq_id, start, filled)
            pages.append(page)
        return sorted(pages)

    def restore(self, page: int) -> bool:
        """Put a marked page back into its sequence's table if it was not reused; True when restored."""
        if page not in self.marked:
            return False
        seq_id, start, filled = self.marked.pop(page)
        table = self.tables[seq_id]
        at = next((i for i, e in enumerate(table) if e[1] > start), len(table))
        table.insert(at, [page, start, filled])
        return True

    def release(self, seq_id) -> None:
        """The sequence is finished: its pages, and its marked pages, become free."""
        for page, _, _ in self.tables.pop(seq_id, []):
            self.free.append(page)
        for page in [p for p, info in self.marked.items() if info[0] == seq_id]:
            del self.marked[page]
            self.free.append(page)
        self.lengths.pop(seq_id, None)
