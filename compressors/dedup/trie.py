"""Exact cross-session prefix dedup: Layer 1 of "Sequential KV Cache Compression via Probabilistic Language
Tries" (arXiv 2604.15356). Sessions that share a token prefix share its KV, which is stored once.

The encoder replays the sessions in order through a radix-trie prefix cache (:mod:`kvbench.core.prefix_cache`,
granularity ``block_size`` tokens; ``budget_tokens`` bounds what it keeps, evicting by ``policy``). Session j
finds its longest cached prefix, ``m_j`` tokens first written by an earlier session ``p_j``, and stores only the
KV of its remaining tokens. Before reusing a prefix the encoder checks that session j's own KV over it is
bit-identical to ``p_j``'s (the model computed it independently for each session); where it is not, the shared
part ends at the first differing block, so that every session decodes to exactly its own KV. CPU kernels can round
a prefix's KV differently for two prompt lengths (by one fp16 step, measured on SmolLM2); ``verify_kv=false``
shares on the token match alone, as a serving prefix cache does, and a session then decodes to the earlier
session's KV for that prefix (no longer bit-exact to its own prefill).

Bitstream sections:

* ``index`` — varints: block size, label width, session count, then per session its length, ``p_j + 1`` and
  ``m_j / block_size``. This is the trie in parent-pointer form: the radix trie's edges are the sessions'
  stored segments and ``(p_j, m_j)`` says where each hangs.
* ``labels`` — the token ids of every stored KV position, packed at ``label width`` bits, so that the stored trie
  can also answer lookups (``labels=false`` stores the KV and topology only).
* ``k``, ``v`` — the stored segments' KV at 16 bits, concatenated along tokens; or, under
  :class:`~compressors.dedup.pipeline.Pipeline`, each segment coded by the inner compressor (sections ``<j>/...``,
  the inner stream's own frame and sections with their exact bit counts, so that the bits add up exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbench.coding.bitstream import Bitstream, BitstreamError, read_varints, varints
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, SetCompressor
from kvbench.core.kv import Context, KVSequence, first_kv_mismatch
from kvbench.core.prefix_cache import POLICIES, PrefixCache


@dataclass
class Plan:
    """Where each session's KV comes from: ``parent[j]`` (-1: none) supplies its first ``shared[j]`` tokens."""

    parent: list[int]
    shared: list[int]


@dataclass
class Trie(SetCompressor):
    """Exact prefix dedup across sessions (arXiv 2604.15356, Layer 1), a radix trie at ``block_size`` tokens.

    One KV sequence alone has nothing to share; the trie acts on a set of sessions (``encode_set``), which
    ``python -m kvbench run +compressor=trie workload=NAME`` supplies."""

    block_size: int = 16
    labels: bool = True
    policy: str = "lru"
    budget_tokens: int | None = None
    plt_weight: float = 1.0
    verify_kv: bool = True

    name = "trie"
    family = "dedup"
    max_rel_mse = 0.0
    lossless = True

    def __post_init__(self) -> None:
        check_range("trie", "block_size", self.block_size, 1, 1 << 16, integer=True)
        check_choice("trie", "labels", self.labels, [True, False])
        check_choice("trie", "policy", self.policy, POLICIES)
        if self.budget_tokens is not None:
            check_range("trie", "budget_tokens", self.budget_tokens, 0, 1 << 62, integer=True)
            self.budget_tokens = int(self.budget_tokens)
        check_range("trie", "plt_weight", self.plt_weight, 0.0, 1e9)
        check_choice("trie", "verify_kv", self.verify_kv, [True, False])
        self.block_size = int(self.block_size)
        # sharing on tokens alone decodes a prefix from another session's prefill: exact only if those agree
        self.lossless = bool(self.verify_kv)

    def prefix_cache(self) -> PrefixCache:
        return PrefixCache(self.block_size, self.budget_tokens, self.policy, self.plt_weight)

    # ---- sets of sessions ---------------------------------------------------------------------------------
    def plan(self, kvs: Sequence[KVSequence], ctxs: Sequence[Context]) -> Plan:
        """Replay the sessions through the prefix cache; keep a reused prefix only where the KV is identical."""
        cache = self.prefix_cache()
        parent, shared = [], []
        for j, (kv, ctx) in enumerate(zip(kvs, ctxs)):
            if kv.tokens is None:  # nothing to match on; a session without token ids stores all of its KV
                parent.append(-1)
                shared.append(0)
                continue
            lp = ctx.extras.get("logprobs")
            got = cache.request(kv.tokens.numpy(), None if lp is None else np.concatenate([[0.0], np.asarray(lp)]), rid=j)
            m, p = got.hit_tokens, got.owner
            if m and self.verify_kv:
                m = first_kv_mismatch(kv, kvs[p], m) // self.block_size * self.block_size
            parent.append(p if m else -1)
            shared.append(m)
        return Plan(parent, shared)

    def encode_set(self, kvs: Sequence[KVSequence], ctxs: Sequence[Context], inner: Compressor | None = None,
                   name: str | None = None) -> Bitstream:
        if len(kvs) != len(ctxs) or not kvs:
            raise ValueError(f"{len(kvs)} sessions for {len(ctxs)} contexts; give one context per session (at least one)")
        plan = self.plan(kvs, ctxs)
        segs = [kv.slice_tokens(m, kv.n_tokens) for kv, m in zip(kvs, plan.shared)]
        labels = [s.tokens.numpy() for s in segs if s.tokens is not None and s.n_tokens]
        if self.labels and any(s.tokens is None for s in segs):
            raise ValueError("trie.labels=true needs the token ids of every session (KVSequence.tokens)")
        all_labels = np.concatenate(labels) if labels and self.labels else np.zeros(0, dtype=np.int64)
        width = int(all_labels.max()).bit_length() if all_labels.size else 0
        index = [self.block_size, width, len(kvs)]
        for kv, p, m in zip(kvs, plan.parent, plan.shared):
            index += [kv.n_tokens, p + 1, m // self.block_size]
        sections: dict[str, bytes | tuple[bytes, int]] = {"index": varints(index), "labels": pack_codes(all_labels, width)}
        if inner is None:
            sections["k"] = tensor_to_bytes(torch.cat([s.k for s in segs], dim=2))  # (L, H, U, D)
            sections["v"] = tensor_to_bytes(torch.cat([s.v for s in segs], dim=2))  # (L, H, U, D)
        else:
            for j, (seg, ctx) in enumerate(zip(segs, ctxs)):
                if seg.n_tokens:
                    sections.update(_reframe(j, inner.encode(seg, _segment_ctx(ctx, seg.n_tokens))))
        return Bitstream.pack(name or self.name, sections)

    def decode_set(self, bs: Bitstream, ctxs: Sequence[Context], inner: Compressor | None = None,
                   name: str | None = None) -> list[KVSequence]:
        sec = bs.sections(expect=name or self.name)
        (block, width, n), pos = read_varints(sec["index"], 3)
        if n != len(ctxs):
            raise BitstreamError(f"the bitstream holds {n} sessions; {len(ctxs)} contexts were given")
        flat, _ = read_varints(sec["index"], 3 * n, pos)
        lengths, parents, shared = flat[0::3], [p - 1 for p in flat[1::3]], [b * block for b in flat[2::3]]
        new = [T - m for T, m in zip(lengths, shared)]
        labels = unpack_codes(sec["labels"], width, sum(new)).long().numpy() if width else None
        if inner is None:
            c = ctxs[0]
            shape = (c.n_layers, c.n_heads, sum(new), c.head_dim)
            k_all = tensor_from_bytes(sec["k"], c.dtype, shape)  # (L, H, U, D)
            v_all = tensor_from_bytes(sec["v"], c.dtype, shape)  # (L, H, U, D)
        out: list[KVSequence] = []
        at = 0
        for j, ctx in enumerate(ctxs):
            if lengths[j] != ctx.n_tokens:
                raise BitstreamError(f"session {j} holds {lengths[j]} tokens; its context says {ctx.n_tokens}")
            if inner is None:
                seg_k, seg_v = k_all[:, :, at : at + new[j]], v_all[:, :, at : at + new[j]]
            elif new[j]:
                seg = inner.decode(_unframe(j, sec), _segment_ctx(ctx, new[j]))
                seg_k, seg_v = seg.k, seg.v
            else:
                seg_k = seg_v = torch.zeros(ctx.n_layers, ctx.n_heads, 0, ctx.head_dim, dtype=ctx.dtype)
            toks = None if labels is None else torch.from_numpy(labels[at : at + new[j]].copy())
            p, m = parents[j], shared[j]
            if m:
                if not 0 <= p < j or out[p].n_tokens < m:
                    raise BitstreamError(f"session {j} refers to session {p}, which cannot supply {m} tokens")
                head = out[p]
                seg_k = torch.cat([head.k[:, :, :m], seg_k], dim=2)  # (L, H, T, D)
                seg_v = torch.cat([head.v[:, :, :m], seg_v], dim=2)  # (L, H, T, D)
                toks = None if toks is None or head.tokens is None else torch.cat([head.tokens[:m], toks])
            out.append(KVSequence(seg_k.contiguous(), seg_v.contiguous(), toks))
            at += new[j]
        return out


def _segment_ctx(ctx: Context, n_tokens: int) -> Context:
    return Context(ctx.n_layers, ctx.n_heads, n_tokens, ctx.head_dim, ctx.dtype, ctx.model, dict(ctx.extras))


def _reframe(j: int, inner_bs: Bitstream) -> dict[str, bytes | tuple[bytes, int]]:
    """The inner stream of segment ``j`` as outer sections: its frame (header and checksum) and each section
    with its exact bit count, so the outer stream counts exactly the inner stream's bits."""
    stored = Bitstream.from_bytes(inner_bs.data)
    payloads = stored.sections()
    body = sum(len(p) for p in payloads.values())
    data = stored.data
    out: dict[str, bytes | tuple[bytes, int]] = {f"{j}/frame": data[: len(data) - 4 - body] + data[-4:]}
    for sname, raw in payloads.items():
        out[f"{j}/{sname}"] = (raw, stored.parts[sname])
    return out


def _unframe(j: int, sec: dict[str, bytes]) -> Bitstream:
    prefix = f"{j}/"
    frame = sec.get(prefix + "frame")
    if frame is None or len(frame) < 4:
        raise BitstreamError(f"segment {j} of the pipeline stream is missing")
    payloads = [raw for sname, raw in sec.items() if sname.startswith(prefix) and sname != prefix + "frame"]
    return Bitstream.from_bytes(frame[:-4] + b"".join(payloads) + frame[-4:])
