"""lm-eval model classes that read the prefix through a compressed cache.

lm-eval's ``HFLM`` scores context and continuation in one forward pass and never reads a cache, so it cannot see a
compressor. :class:`CompressedKVLM` instead, for each request,

1. prefills the context (all but its last token) once, with a plain cache;
2. loads that KV into a :class:`~kvbench.cache.compressed.CompressedCache` (the compressor codes it; the bytes are all that
   is kept) and, on identical terms, into the uncompressed 16-bit baseline cache;
3. ``loglikelihood``: feeds the context's last token and the continuation on top of each cache, so every scored
   token attends to the reconstructed prefix; ``generate_until``: greedy ``model.generate`` with each cache.

The prefill is shared, so the baseline costs only the scoring passes. The compressed results go back to lm-eval;
the baseline's are kept for :class:`ReplayLM`, which hands them to a second lm-eval pass over the same requests,
so both sets of metrics come from lm-eval's own metric code on identical examples.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch
from lm_eval.api.model import LM
from tqdm import tqdm
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from kvbench.cache.compressed import CompressedCache
from kvbench.core.compressor import Compressor


def _gen_key(context: str, gen_kwargs: dict) -> tuple:
    return ("gen", context, json.dumps(gen_kwargs, sort_keys=True, default=str))


def _bar(iterable: Any = None, **kw: Any) -> tqdm:
    # disable=None: drawn on a terminal, silent in logs and pipes
    return tqdm(iterable, leave=False, disable=None, **kw)


class _StopStrings(StoppingCriteria):
    """Stop greedy generation once the text generated so far contains a stop string: the answer is cut there
    anyway, so the tokens after it cost time and change nothing (both sides stop by the same rule)."""

    def __init__(self, tokenizer: Any, start: int, until: list[str]) -> None:
        self.tok, self.start, self.until = tokenizer, start, [u for u in until if u]

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        text = self.tok.decode(input_ids[0, self.start :], skip_special_tokens=True)
        done = any(u in text for u in self.until)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _TokenBar(BaseStreamer):
    """A progress bar over one ``generate`` call's new tokens; it shows only if the call runs past ``delay`` seconds."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar = _bar(total=total, desc=desc, unit="tok", delay=1.0)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:  # generate() hands over the prompt first
            self.bar.update(int(value.numel()))
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


class CompressedKVLM(LM):
    """Scores requests with ``compressor`` and with the 16-bit baseline, sharing each prefill."""

    def __init__(self, handle: Any, compressor: Compressor, *, residual: int | None = 0, chunk: int = 128,
                 mode: str = "auto", dtype: torch.dtype = torch.float16, progress: bool = True) -> None:
        super().__init__()
        self.handle, self.compressor = handle, compressor
        self.cache_kw = {"residual": residual, "chunk": chunk, "mode": mode, "dtype": dtype}
        self.progress = progress
        self.model, self.tok = handle.model, handle.tokenizer
        self._device = next(self.model.parameters()).device
        cfg = self.model.config.get_text_config(decoder=True)
        self.max_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.kv_elements_per_token = 2 * cfg.num_hidden_layers * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * (
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eos = self.tok.eos_token_id
        self.baseline: dict[tuple, Any] = {}
        self.accounting = defaultdict(float)

    # ------------------------------------------------------------------ helpers
    def _enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As lm-eval's HFLM: trailing spaces of the context move to the continuation; split on the joint tokens."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self._enc(context) or [self.eos]
        whole = self._enc(context + continuation)
        cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else self._enc(continuation)
        return ctx, cont

    def _cache(self, compressor: Compressor | None) -> CompressedCache:
        # accuracy depends on the decoded values only: each segment is decoded once from its bytes, not per token
        return CompressedCache(compressor, model=self.handle, hold="decoded", **self.cache_kw)

    @torch.no_grad()
    def _prefill(self, ids: list[int]) -> DynamicCache:
        cache = DynamicCache()  # full layers only: sliding-window layers keep every token, as in capture
        if ids:
            self.model(torch.tensor([ids], device=self._device), cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def _load(self, compressor: Compressor | None, prefill: DynamicCache, ids: list[int]) -> CompressedCache:
        cache = self._cache(compressor)
        if ids:
            cache.load(prefill, torch.tensor(ids))
        if compressor is not None:
            s = cache.stats()
            self.accounting["contexts"] += 1
            self.accounting["compressed_tokens"] += s["compressed_tokens"]
            self.accounting["window_tokens"] += s["window_tokens"]
            self.accounting["segment_bits"] += 8 * s["segment_bytes"]
            self.accounting["held_bytes"] += s["nbytes"]
            self.accounting["encode_s"] += s["encode_s"]
        return cache

    @torch.no_grad()
    def _score(self, cache: CompressedCache, last: int, cont: list[int]) -> tuple[float, bool]:
        c = cache.clone()
        before = c.stats()["decode_s"]
        inp = torch.tensor([[last, *cont[:-1]]], device=self._device)
        logits = self.model(inp, cache=c, use_cache=True).logits[0].float()  # (n, V)
        if cache.compressor is not None:
            self.accounting["decode_s"] += c.stats()["decode_s"] - before
        target = torch.tensor(cont, device=self._device)
        logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        return float(logp.sum()), bool((logits.argmax(-1) == target).all())

    def _truncate(self, ctx: list[int], room: int) -> list[int]:
        keep = self.max_length - room
        return ctx[-keep:] if len(ctx) > keep else ctx

    # ------------------------------------------------------------------ lm-eval API
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        groups: dict[tuple[int, ...], list[tuple[int, tuple, list[int]]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            if not cont:
                raise ValueError(f"empty continuation after tokenization for request {req.args!r}")
            groups[tuple(self._truncate(ctx, len(cont)))].append((i, req.args, cont))
        out: list[Any] = [None] * len(requests)
        for ctx, items in (_bar(groups.items(), desc="loglikelihood") if self.progress else groups.items()):
            prefix, last = list(ctx[:-1]), ctx[-1]
            prefill = self._prefill(prefix)
            comp, base = self._load(self.compressor, prefill, prefix), self._load(None, prefill, prefix)
            del prefill
            for i, args, cont in items:
                out[i] = self._score(comp, last, cont)
                self.baseline[("ll", *args)] = self._score(base, last, cont)
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        raise NotImplementedError("kvbench tasks score continuations of a cached prefix; rolling perplexity is `python -m kvbench run`")

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        out = []
        for req in (_bar(requests, desc="generate_until") if self.progress else requests):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or [self.tok.decode([self.eos])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            ctx = self._truncate(self._enc(context) or [self.eos], max_new)
            prefill = self._prefill(ctx[:-1])
            texts = []
            for compressor in (self.compressor, None):
                cache = self._load(compressor, prefill, ctx[:-1])
                texts.append(self._generate(cache, ctx, max_new, until, "compressed" if compressor is not None else "baseline"))
            out.append(texts[0])
            self.baseline[_gen_key(context, req.args[1])] = texts[1]
        return out

    def _generate(self, cache: CompressedCache, ctx: list[int], max_new: int, until: list[str], desc: str = "generate") -> str:
        ids = torch.tensor([ctx], device=self._device)
        before = cache.stats()["decode_s"]
        gen = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=max_new,
                                  do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=self.eos,
                                  stopping_criteria=StoppingCriteriaList([_StopStrings(self.tok, len(ctx), until)]),
                                  streamer=_TokenBar(max_new, desc) if self.progress else None)
        if cache.compressor is not None:
            self.accounting["decode_s"] += cache.stats()["decode_s"] - before
            self.accounting["generated_tokens"] += gen.shape[1] - len(ctx)
        text = self.tok.decode(gen[0, len(ctx):], skip_special_tokens=True)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text

    def replay(self) -> ReplayLM:
        """The baseline's answers to the requests seen so far, as an lm-eval model."""
        return ReplayLM(self.baseline)


class ReplayLM(LM):
    """Answers lm-eval requests from stored results (the baseline side of a :class:`CompressedKVLM` pass)."""

    def __init__(self, store: dict[tuple, Any]) -> None:
        super().__init__()
        self.store = store

    def _get(self, key: tuple) -> Any:
        if key not in self.store:
            raise KeyError(f"no stored baseline result for request {key[:2]!r}; run the compressed pass first")
        return self.store[key]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return [self._get(("ll", *r.args)) for r in requests]

    def loglikelihood_rolling(self, requests) -> list[float]:
        raise NotImplementedError("kvbench tasks do not use rolling loglikelihood")

    def generate_until(self, requests) -> list[str]:
        return [self._get(_gen_key(r.args[0], r.args[1])) for r in requests]
