"""An exact radix trie over token ids, at a granularity of ``block_size`` tokens.

Edges are runs of whole blocks. Every stored token lives once in one flat numpy array (``labels``); a node is a
handful of Python ints (parent, label offset, length, depth, owner) and a dict of children keyed by the first
block of the child's edge, so memory grows with the unique tokens and the number of branch points, never with
one Python object per token. A walk costs one dict lookup and one vectorised comparison per node on the path,
so insert and lookup are linear in the tokens of the sequence. Optional per-token values (log-probabilities for
the probabilistic language trie) are stored alongside the labels and follow them through splits.

Only whole blocks enter the trie, as in paged prefix caches (vLLM, SGLang with ``page_size > 1``): the tail of a
sequence that does not fill a block is never shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROOT = 0


@dataclass
class Match:
    """The result of walking a sequence down the trie."""

    tokens: int  # length of the longest stored prefix (a multiple of block_size)
    node: int  # the deepest node the match enters (ROOT when nothing matched)
    offset: int  # tokens of ``node``'s edge inside the match (== its length when the whole edge matched)
    path: list[int]  # nodes entered, root excluded


class RadixTrie:
    """Exact radix trie over integer token ids (or block hash ids) with ``block_size``-token granularity."""

    def __init__(self, block_size: int = 1, with_values: bool = False) -> None:
        if int(block_size) != block_size or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a whole number >= 1")
        self.block_size = int(block_size)
        self.with_values = with_values
        self._labels = np.empty(1 << 12, dtype=np.int64)
        self._values = np.empty(1 << 12, dtype=np.float64) if with_values else None
        self._used = 0  # slots of ``_labels`` written so far (trimmed or evicted tokens stay as garbage)
        self.n_tokens = 0  # tokens on live edges
        # one column per node field; index = node id
        self.parent: list[int] = [-1]
        self.start: list[int] = [0]
        self.length: list[int] = [0]
        self.depth: list[int] = [0]  # tokens from the root to the end of the node's edge
        self.owner: list[int] = [-1]  # a sequence whose prefix runs through the whole edge
        self.value_sum: list[float] = [0.0]  # sum of the per-token values from the root to the end of the edge
        self.children: list[dict] = [{}]
        self.alive: list[bool] = [True]

    # ---- storage -------------------------------------------------------------------------------------------
    def _append(self, tokens: np.ndarray, values: np.ndarray | None) -> int:
        n = tokens.size
        if self._used + n > self._labels.size:
            cap = max(self._labels.size * 2, self._used + n)
            self._labels = np.resize(self._labels, cap)
            if self._values is not None:
                self._values = np.resize(self._values, cap)
        at = self._used
        self._labels[at : at + n] = tokens
        if self._values is not None:
            self._values[at : at + n] = 0.0 if values is None else values
        self._used += n
        return at

    def _key(self, arr: np.ndarray, pos: int):
        # block_size 1 keys on the token itself; larger blocks on their bytes (exact, no hash collisions)
        return int(arr[pos]) if self.block_size == 1 else arr[pos : pos + self.block_size].tobytes()

    def label(self, node: int) -> np.ndarray:
        """The token ids on the edge into ``node``."""
        s = self.start[node]
        return self._labels[s : s + self.length[node]]

    def _as_ids(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token ids must be a 1-D integer array; got {arr.dtype} of shape {arr.shape}")
        return arr.astype(np.int64, copy=False)

    def _new_node(self, parent: int, start: int, length: int, owner: int, value_sum: float) -> int:
        self.parent.append(parent)
        self.start.append(start)
        self.length.append(length)
        self.depth.append(self.depth[parent] + length)
        self.owner.append(owner)
        self.value_sum.append(value_sum)
        self.children.append({})
        self.alive.append(True)
        return len(self.parent) - 1

    # ---- walking -------------------------------------------------------------------------------------------
    def match(self, tokens) -> Match:
        """Longest stored prefix of ``tokens`` at block granularity. Does not modify the trie."""
        toks = self._as_ids(tokens)
        B = self.block_size
        n_full = toks.size // B * B
        node, pos, path = ROOT, 0, []
        while pos < n_full:
            child = self.children[node].get(self._key(toks, pos))
            if child is None:
                break
            path.append(child)
            L = self.length[child]
            span = min(L, n_full - pos)
            s = self.start[child]
            a, b = toks[pos : pos + span], self._labels[s : s + span]
            if np.array_equal(a, b):
                same = span
            else:
                same = int(np.flatnonzero(a != b)[0]) // B * B
            if same < L:
                return Match(pos + same, child, same, path)
            pos, node = pos + L, child
        return Match(pos, node, self.length[node], path)

    def insert(self, tokens, owner: int = -1, values=None) -> Match:
        """Store every whole block of ``tokens``; return the match found *before* inserting.

        ``owner`` labels the nodes this call creates; ``values`` (same length as ``tokens``) are kept per token
        when the trie was built ``with_values``.
        """
        toks = self._as_ids(tokens)
        vals = None
        if self.with_values and values is not None:
            vals = np.asarray(values, dtype=np.float64)
            if vals.shape != toks.shape:
                raise ValueError(f"{vals.size} values for {toks.size} tokens")
        m = self.match(toks)
        node = m.node
        if m.offset < self.length[node]:
            node = self._split(node, m.offset)
            m.path[-1] = node
        n_full = toks.size // self.block_size * self.block_size
        if m.tokens < n_full:
            new = toks[m.tokens : n_full]
            new_vals = None if vals is None else vals[m.tokens : n_full]
            at = self._append(new, new_vals)
            vsum = self.value_sum[node] + (float(new_vals.sum()) if new_vals is not None else 0.0)
            leaf = self._new_node(node, at, new.size, owner, vsum)
            self.children[node][self._key(toks, m.tokens)] = leaf
            self.n_tokens += new.size
            m.path.append(leaf)
        return m

    def _split(self, node: int, offset: int) -> int:
        """Cut ``node``'s edge after ``offset`` tokens; the new upper node takes its place under the parent."""
        par, s = self.parent[node], self.start[node]
        upper_sum = self.value_sum[par] + (float(self._values[s : s + offset].sum()) if self._values is not None else 0.0)
        upper = self._new_node(par, s, offset, self.owner[node], upper_sum)
        self.children[par][self._key(self._labels, s)] = upper
        self.children[upper][self._key(self._labels, s + offset)] = node
        self.parent[node] = upper
        self.start[node] = s + offset
        self.length[node] -= offset
        return upper

    # ---- removal (prefix caches evict leaves) --------------------------------------------------------------
    def is_leaf(self, node: int) -> bool:
        return node != ROOT and self.alive[node] and not self.children[node]

    def trim(self, node: int, n: int) -> None:
        """Drop the last ``n`` tokens (whole blocks) of a leaf's edge; the whole edge removes the leaf."""
        if not self.is_leaf(node):
            raise ValueError(f"node {node} is not a live leaf; only leaves can be evicted")
        if n % self.block_size or not 0 < n <= self.length[node]:
            raise ValueError(f"cannot trim {n} tokens from an edge of {self.length[node]} (block {self.block_size})")
        self.n_tokens -= n
        if n == self.length[node]:
            par = self.parent[node]
            del self.children[par][self._key(self._labels, self.start[node])]
            self.alive[node] = False
            self.children[node] = {}
            return
        if self._values is not None:
            s = self.start[node] + self.length[node]
            self.value_sum[node] -= float(self._values[s - n : s].sum())
        self.length[node] -= n
        self.depth[node] -= n

    # ---- size ----------------------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        """Live nodes, root excluded."""
        return sum(self.alive) - 1

    def index_nbytes(self) -> int:
        """Bytes of the stored labels (and values): the part that scales with unique tokens."""
        per = self._labels.itemsize + (self._values.itemsize if self._values is not None else 0)
        return self._used * per
