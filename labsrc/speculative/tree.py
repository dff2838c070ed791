"""Tree speculation: several drafts verified at once as a tree, with the tree attention mask and the
cache rows of the accepted branch kept.
"""
from __future__ import annotations

import time

import torch

from labsrc.speculative.common import _eos_ids, _forward, _new_cache, _rollback
from labsrc.speculative.generate import SpecStats, StepStats
from labsrc.speculative.theory import _check_k


# ----------------------------------------------------------------------------------------------- trees
def tree_attention_mask(parents) -> torch.Tensor:
    """The ancestor-or-self mask of a draft tree: ``mask[i, j]`` true when node ``j`` is node ``i`` or an
    ancestor of it. ``parents[i]`` is the index of node ``i``'s parent (``< i``: parents come first), or ``-1``
    for a node that hangs directly off the verified prefix. Returns ``(N, N)`` bool."""
    if isinstance(parents, torch.Tensor):
        if parents.dtype.is_floating_point or parents.dim() != 1:
            raise ValueError(f"parents must be a 1-D integer sequence, got {parents.dtype} {tuple(parents.shape)}")
        parents = parents.tolist()
    parents = list(parents)
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        if isinstance(par, bool) or not isinstance(par, int):
            raise ValueError(f"parents[{i}] must be an int, got {par!r}")
        if not -1 <= par < i:
            raise ValueError(f"parents[{i}] = {par}: a parent must come before its child (-1 <= parent < {i})")
        mask[i, i] = True
        if par >= 0:
            mask[i] |= mask[par]
    return mask


def tree_depths(parents) -> list[int]:
    """Depth of each node (1 for a child of the prefix): its position offset after the prefix."""
    depth = []
    for par in list(parents):
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


# ----------------------------------------------------------------------------------------------- tree generation
_TREE_MASK: list = []      # (ancestor mask, use_kernel) of the tree being verified, set around the target call
_TREE_ATTN = "lab_tree"


def _tree_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: the tree's queries against prefix + tree under the ancestor mask."""
    from labsrc.kernels.speculative import tree_attention, tree_attention_ref
    mask, use_kernel = _TREE_MASK[-1]
    n = query.shape[2]
    if key.shape[2] < n or mask.shape[-1] != n:
        raise ValueError(f"tree attention: {n} queries but a tree mask for {mask.shape[-1]} nodes")
    fn = tree_attention if use_kernel else tree_attention_ref
    out = fn(query.contiguous(), key, value, mask.to(query.device), sm_scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_tree_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(_TREE_ATTN, _tree_attention_forward)
    AttentionMaskInterface.register(_TREE_ATTN, sdpa_mask)


@torch.no_grad()
def tree_verify_logits(target, cache, tokens: torch.Tensor, parents, position0: int,
                       use_kernel: bool = True) -> torch.Tensor:
    """One target forward over a token tree after ``cache``: node ``i`` (token ``tokens[i]``, parent
    ``parents[i]``, ``-1`` for the root's level) sits at position ``position0 + depth(i) - 1`` and attends to the
    cache and its ancestors (the Triton tree-attention kernel). Returns the logits ``(N, V)``; the cache then
    holds all ``N`` nodes (cut it back with :func:`_keep_cache_positions`). ``use_kernel=False`` runs the
    PyTorch reference of the same attention instead (same numbers; faster under the Triton interpreter)."""
    _register_tree_attention()
    depth = torch.tensor(tree_depths(parents))
    pos = (position0 + depth - 1)[None].to(tokens.device)
    previous = target.config._attn_implementation
    _TREE_MASK.append((tree_attention_mask(parents), use_kernel))
    try:
        target.set_attn_implementation(_TREE_ATTN)
        out = target(input_ids=tokens[None], cache=cache, position_ids=pos, use_cache=True)
    finally:
        target.set_attn_implementation(previous)
        _TREE_MASK.pop()
    return out.logits[0].float()


def _keep_cache_positions(cache, keep: torch.Tensor) -> None:
    """Keep only cache positions ``keep`` (a 1-D index tensor) in every layer of a transformers cache."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


@torch.no_grad()
def tree_speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                              branches: int = 2, stats: SpecStats | None = None, stop_at_eos: bool = True,
                              use_kernel: bool = True) -> tuple[torch.Tensor, SpecStats]:
    """Greedy tree speculation: per cycle the draft walks its greedy path for ``k`` steps and at every depth
    also offers its next ``branches - 1`` most likely tokens as siblings (a tree of ``1 + k * branches``
    nodes, the verified last token as root); the target verifies the whole tree in one forward with the
    tree-attention kernel and accepts the longest root path whose every token is its own argmax. Output is
    token-identical to the target's greedy decoding. ``branches=1`` is the chain. Returns ``(ids, stats)``."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    _check_k(k)
    _check_k(branches, "branches")
    stats = SpecStats() if stats is None else stats
    device = next(target.parameters()).device
    seq = input_ids.to(device)
    eos = _eos_ids(target) if stop_at_eos else set()
    t_start = time.perf_counter()
    tcache, dcache = _new_cache(target), _new_cache(draft)
    if seq.shape[1] > 1:
        _forward(target, seq[:, :-1], tcache)
        _forward(draft, seq[:, :-1], dcache)
    produced = 0
    while produced < max_new_tokens:
        kk = min(k, max_new_tokens - produced - 1)
        t0 = time.perf_counter()
        # ---- draft: greedy path of kk tokens; siblings = the next-best tokens at each depth
        tokens, parents = [int(seq[0, -1])], [-1]
        path_node = 0
        pending = seq[:, dcache.get_seq_length():]
        path = []
        for _ in range(kk):
            logits = _forward(draft, pending, dcache)[-1]
            top = logits.topk(branches).indices.tolist()
            first = len(tokens)
            for tok in top:
                tokens.append(tok)
                parents.append(path_node)
            path_node = first
            path.append(top[0])
            pending = torch.tensor([[top[0]]], device=device)
        stats.draft_calls += kk
        t_draft = time.perf_counter() - t0
        # ---- target: the whole tree in one forward
        t0 = time.perf_counter()
        L = tcache.get_seq_length()
        logits = tree_verify_logits(target, tcache, torch.tensor(tokens, device=device), parents, L,
                                    use_kernel)
        stats.target_calls += 1
        best = logits.argmax(-1).tolist()
        children = {}
        for i, par in enumerate(parents):
            if par >= 0:
                children.setdefault(par, []).append(i)
        node, accepted_nodes = 0, []
        while True:
            nxt = [c for c in children.get(node, []) if tokens[c] == best[node]]
            if not nxt:
                break
            node = nxt[0]
            accepted_nodes.append(node)
        emitted = [tokens[i] for i in accepted_nodes] + [best[node]]
        t_target = time.perf_counter() - t0
        for j, t in enumerate(emitted):
            if t in eos:
                emitted = emitted[: j + 1]
                break
        n_acc = len(accepted_nodes)
        keep = torch.cat([torch.arange(L + 1), L + torch.tensor(accepted_nodes, dtype=torch.long)]).to(device)
        _keep_cache_positions(tcache, keep[: L + 1 + max(0, len(emitted) - 1)])
        seq = torch.cat([seq, torch.tensor([emitted], device=device)], dim=1)
        produced += len(emitted)
        # the draft cached its own greedy path: keep the part that agrees with what was emitted
        agree = 0
        while agree < min(len(path) - 1, len(emitted)) and path[agree] == emitted[agree]:
            agree += 1
        _rollback(dcache, min(dcache.get_seq_length(), L + 1 + agree, seq.shape[1] - 1))
        stats.steps.append(StepStats(k=kk, drafted=len(tokens) - 1, accepted=n_acc, emitted=len(emitted),
                                     draft_seconds=t_draft, target_seconds=t_target,
                                     accepted_mask=tuple(j < n_acc for j in range(kk))))
        if emitted and emitted[-1] in eos:
            break
    stats.new_tokens += min(produced, max_new_tokens)
    stats.wall_seconds += time.perf_counter() - t_start
    return seq[:, : input_ids.shape[1] + max_new_tokens], stats
