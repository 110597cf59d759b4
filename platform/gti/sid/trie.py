"""Prefix trie over all valid SIDs, as token-id sequences, answered with tensor ops.

What it is for: constrained decoding. At step t a beam search holds B = users x beams prefixes
of t SID tokens and needs, per row, the mask of new tokens that extend the prefix towards some
catalog item; after L steps it needs the item each finished SID names. `allowed()` answers the
first for a whole batch at once and `item_index()` the second; no Python loop runs per beam
(only one per depth, at most L). The layout is on `SidTrie`.

What it does not know: tokenizers or code spelling (see `gti.sid.codec`), models, Ray.
"""

from __future__ import annotations

import torch


class SidTrie:
    """Trie over `sid_token_ids` LongTensor[N_items, L], all ids in [vocab_new_start, vocab_new_end).

    Args:
        sid_token_ids: token ids of each item's SID, one row per item (row = item index).
        vocab_new_start, vocab_new_end: the new-token id slice [start, end); masks are over it.
        dense_max_bytes: per depth, keep a dense [n_nodes, V_new] bool table when it fits in
            this many bytes (faster `allowed`); 0 disables dense tables.

    Duplicate SIDs are allowed; `item_index` then returns the lowest row (`has_duplicates`
    says whether that happened; a finished `sid` stage never produces them).

    Layout: tokens are made local (`token - vocab_new_start`, in [0, V_new)). Depth d holds the
    sorted unique keys `parent_node * V_new + token` of every edge leaving depth d; the position
    of a key in that array is the child's node id at depth d+1. Because the keys are sorted by
    parent first, they are also a CSR of each node's children, so a node's allowed tokens are
    one contiguous slice. Finding the node of a prefix is one `searchsorted` per depth. Where
    `n_nodes(d) * V_new` is small, a dense bool table per depth is kept as well and `allowed()`
    is a single gather; otherwise the mask is built from the CSR slices with repeat_interleave +
    scatter. Memory is O(N * L) plus the optional dense tables.
    """

    def __init__(
        self,
        sid_token_ids: torch.Tensor,
        vocab_new_start: int,
        vocab_new_end: int,
        dense_max_bytes: int = 64 * 2**20,
    ) -> None:
        ids = torch.as_tensor(sid_token_ids, dtype=torch.long)
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"sid_token_ids must be a non-empty [N, L] tensor, got {list(ids.shape)}")
        self.vocab_new_start = int(vocab_new_start)
        self.vocab_new_end = int(vocab_new_end)
        self.v_new = self.vocab_new_end - self.vocab_new_start
        if self.v_new <= 0:
            raise ValueError(f"empty new-token range [{vocab_new_start}, {vocab_new_end})")
        x = ids.cpu() - self.vocab_new_start
        if (x < 0).any() or (x >= self.v_new).any():
            r = int(((x < 0) | (x >= self.v_new)).any(dim=1).nonzero()[0])
            raise ValueError(
                f"SID row {r} has token ids {ids[r].tolist()} outside [{vocab_new_start}, {vocab_new_end})"
            )
        self.num_items, self.levels = int(x.shape[0]), int(x.shape[1])
        v = self.v_new
        self._keys: list[torch.Tensor] = []  # per depth: sorted unique parent*V + token
        self._indptr: list[torch.Tensor] = []  # per depth: CSR row pointers, [n_nodes(d) + 1]
        self._dense: list[torch.Tensor | None] = []  # per depth: [n_nodes(d) + 1, V] bool or None
        node = torch.zeros(self.num_items, dtype=torch.long)  # node of each item at depth d
        n_nodes = 1
        for d in range(self.levels):
            keys, child = torch.unique(node * v + x[:, d], sorted=True, return_inverse=True)
            indptr = torch.searchsorted(keys, torch.arange(n_nodes + 1, dtype=torch.long) * v)
            self._keys.append(keys)
            self._indptr.append(indptr)
            if 0 < (n_nodes + 1) * v <= dense_max_bytes:
                # One extra all-False last row: node -1 indexes it, so the lookup is one gather.
                dense = torch.zeros(n_nodes + 1, v, dtype=torch.bool)
                dense[keys // v, keys % v] = True
                self._dense.append(dense)
            else:
                self._dense.append(None)
            node, n_nodes = child, int(keys.numel())
        # Leaves are the distinct SIDs; map each to the lowest item row that carries it.
        self.num_unique = n_nodes
        self.has_duplicates = n_nodes != self.num_items
        self._leaf_item = torch.full((n_nodes,), self.num_items, dtype=torch.long)
        self._leaf_item.scatter_reduce_(0, node, torch.arange(self.num_items), reduce="amin")
        self.device = torch.device("cpu")

    def to(self, device: torch.device | str) -> "SidTrie":
        """Move the tables to `device` (in place; returns self)."""
        device = torch.device(device)
        self._keys = [k.to(device) for k in self._keys]
        self._indptr = [p.to(device) for p in self._indptr]
        self._dense = [None if t is None else t.to(device) for t in self._dense]
        self._leaf_item = self._leaf_item.to(device)
        self.device = device
        return self

    # ------------------------------------------------------------------ node-level API
    def root(self, batch: int) -> torch.Tensor:
        """LongTensor[B] of root nodes (depth 0), the start state for incremental decoding."""
        return torch.zeros(batch, dtype=torch.long, device=self.device)

    def advance(self, nodes: torch.Tensor, depth: int, tokens: torch.Tensor) -> torch.Tensor:
        """Children at depth+1 of `nodes` (at depth `depth`) along `tokens` (global ids) [B].

        Rows whose node is -1 or whose token is not an edge of the trie become -1.
        """
        keys = self._keys[depth]
        v = self.v_new
        local = tokens.to(self.device, torch.long) - self.vocab_new_start
        ok = (nodes >= 0) & (local >= 0) & (local < v)
        q = nodes.clamp(min=0) * v + local.clamp(0, v - 1)
        idx = torch.searchsorted(keys, q)
        idx_c = idx.clamp(max=keys.numel() - 1)
        ok &= keys[idx_c] == q
        return torch.where(ok, idx_c, torch.full_like(idx_c, -1))

    def allowed_at(self, nodes: torch.Tensor, depth: int) -> torch.Tensor:
        """BoolTensor[B, V_new]: tokens leaving `nodes` at depth `depth`; all False for -1."""
        dense = self._dense[depth]
        if dense is not None:
            return dense[nodes]
        b = nodes.shape[0]
        valid = nodes >= 0
        safe = nodes.clamp(min=0)
        keys, indptr = self._keys[depth], self._indptr[depth]
        start = indptr[safe]
        count = torch.where(valid, indptr[safe + 1] - start, torch.zeros_like(start))
        mask = torch.zeros(b, self.v_new, dtype=torch.bool, device=self.device)
        total = int(count.sum())
        if total == 0:
            return mask
        rows = torch.repeat_interleave(torch.arange(b, device=self.device), count, output_size=total)
        first = torch.repeat_interleave(start - (count.cumsum(0) - count), count, output_size=total)
        pos = first + torch.arange(total, device=self.device)
        mask[rows, keys[pos] % self.v_new] = True
        return mask

    def nodes_of(self, prefixes: torch.Tensor) -> torch.Tensor:
        """Node id (at depth t) of each prefix [B, t]; -1 for prefixes no SID starts with."""
        prefixes = torch.as_tensor(prefixes, dtype=torch.long).to(self.device)
        if prefixes.ndim != 2 or prefixes.shape[1] > self.levels:
            raise ValueError(f"prefixes must be [B, t] with t <= {self.levels}, got {list(prefixes.shape)}")
        nodes = self.root(prefixes.shape[0])
        for d in range(prefixes.shape[1]):
            nodes = self.advance(nodes, d, prefixes[:, d])
        return nodes

    # ------------------------------------------------------------------ contract API
    def allowed(self, prefixes: torch.Tensor) -> torch.Tensor:
        """BoolTensor[B, V_new]: mask over the new-token slice of the tokens that may follow
        each prefix (LongTensor[B, t], 0 <= t < L, global token ids). Invalid prefix -> all False."""
        prefixes = torch.as_tensor(prefixes, dtype=torch.long)
        t = prefixes.shape[1] if prefixes.ndim == 2 else -1
        if not 0 <= t < self.levels:
            raise ValueError(f"prefixes must be [B, t] with 0 <= t < {self.levels}, got {list(prefixes.shape)}")
        return self.allowed_at(self.nodes_of(prefixes), t)

    def item_index(self, sid_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[B]: row of the item whose SID is `sid_ids` [B, L] (global ids); -1 if none."""
        sid_ids = torch.as_tensor(sid_ids, dtype=torch.long)
        if sid_ids.ndim != 2 or sid_ids.shape[1] != self.levels:
            raise ValueError(f"sid_ids must be [B, {self.levels}], got {list(sid_ids.shape)}")
        leaf = self.nodes_of(sid_ids)
        item = self._leaf_item[leaf.clamp(min=0)]
        return torch.where(leaf >= 0, item, torch.full_like(item, -1))
