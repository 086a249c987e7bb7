"""``mixed``: a request stream mixing the sharing families with unrelated sessions, at a target share rate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.inputs.workloads.base import Session, Workload, WorkloadBuilder, sharing_stats
from kvbench.inputs.workloads.doc_qa import DocQA
from kvbench.inputs.workloads.fewshot import FewShot
from kvbench.inputs.workloads.multiturn import MultiTurn
from kvbench.inputs.workloads.shared_system import SharedSystem
from kvbench.inputs.workloads.text import passages

FAMILIES = {"shared_system": SharedSystem, "fewshot": FewShot, "doc_qa": DocQA, "multiturn": MultiTurn}


@dataclass
class Mixed(WorkloadBuilder):
    """``n_sessions`` sessions: some from the sharing ``families`` (each built with its defaults), the rest
    unrelated passages of ``unrelated_tokens`` tokens with no template (they share nothing). The number of
    family sessions is the one whose token-level share rate comes closest to ``target_share_rate``; families
    contribute whole groups first (a task, a document, a conversation), round-robin. Arrival order is a seeded
    interleaving that keeps each family's own order (a conversation's turns stay in turn order).
    ``family_params`` overrides family fields, e.g. ``{fewshot: {source: bigbench, task_dir: DIR, tasks: [t]}}``;
    the entries of families not mixed in are unused."""

    n_sessions: int = 32
    target_share_rate: float = 0.5
    families: list = field(default_factory=lambda: ["shared_system", "fewshot", "doc_qa", "multiturn"])
    unrelated_tokens: int = 256
    family_params: dict = field(default_factory=dict)

    name = "mixed"

    def __post_init__(self) -> None:
        self._check(n_sessions=(1, 1 << 20), target_share_rate=(0.0, 1.0), unrelated_tokens=(1, 1 << 20))
        self.families = [self.families] if isinstance(self.families, str) else list(self.families)
        for f in self.families:
            if f not in FAMILIES:
                raise ValueError(f"mixed.families: {f!r} is not a family; choose from {sorted(FAMILIES)}")
        # params of a known family that is not mixed in are kept unused, so that a preset's settings for one
        # family survive an override of the families
        for f in self.family_params:
            if f not in FAMILIES:
                raise ValueError(f"mixed.family_params: {f!r} is not a family; choose from {sorted(FAMILIES)}")

    def _family(self, i: int, name: str) -> WorkloadBuilder:
        kw = {"seed": self.seed + 1000 * (i + 1), "eval_tokens": self.eval_tokens, **self.family_params.get(name, {})}
        if name == "multiturn":  # enough conversations to fill every slot
            kw.setdefault("n_conversations", -(-self.n_sessions // kw.get("n_turns", MultiTurn.n_turns)))
        else:
            kw["n_sessions"] = self.n_sessions
        try:
            return FAMILIES[name](**kw)
        except TypeError as e:
            raise ValueError(f"mixed.family_params.{name}: {e}") from e

    def build(self, tokenizer: Any, docs: list[str]) -> Workload:
        # each pool: (arrival index within the family, session), whole groups first, so that a few sessions of
        # a family still share something
        pools: list[list[tuple[int, Session]]] = []
        for i, name in enumerate(self.families):
            got = self._family(i, name).build(tokenizer, docs).sessions
            first_seen: dict[str, int] = {}
            for k, s in enumerate(got):
                first_seen.setdefault(s.group, k)
            pools.append(sorted(enumerate(got), key=lambda ks: (first_seen[ks[1].group], ks[0])))
        texts = passages(docs, tokenizer, self.n_sessions, self.unrelated_tokens, self.seed + 7)
        pools.append([(i, Session(t, "unrelated", f"u{i}")) for i, t in enumerate(texts)])

        def pick(k: int) -> list[list[Session]]:
            F = len(pools) - 1
            counts = [k // F + (f < k % F) for f in range(F)] + [self.n_sessions - k]
            return [[s for _, s in sorted(pool[:c], key=lambda ks: ks[0])] for pool, c in zip(pools, counts)]

        best_k, best_rate, rates = 0, 0.0, []
        for k in range(self.n_sessions + 1):
            rate = sharing_stats([s.tokens for g in pick(k) for s in g], 1)["share_rate"]
            rates.append(rate)
            if abs(rate - self.target_share_rate) < abs(best_rate - self.target_share_rate):
                best_k, best_rate = k, rate
        if self.target_share_rate > max(rates) + 0.05:
            raise ValueError(f"mixed.target_share_rate={self.target_share_rate} is above what families "
                             f"{self.families} reach with n_sessions={self.n_sessions} (at most {max(rates):.3f}); "
                             "lower it or use more sessions")
        groups = pick(best_k)
        labels = np.concatenate([np.full(len(g), f, dtype=int) for f, g in enumerate(groups)])
        labels = np.random.default_rng(self.seed).permutation(labels)
        cursors = [0] * len(groups)
        sessions = []
        for f in labels:
            sessions.append(groups[f][cursors[f]])
            cursors[f] += 1
        meta = {**self.describe(), "family_sessions": best_k, "unrelated_sessions": self.n_sessions - best_k}
        return Workload(self.name, sessions, meta)
