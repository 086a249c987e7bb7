"""lm-eval model classes that read the prompt's context through a compressed cache.

lm-eval's ``HFLM`` scores context and continuation in one forward pass and never reads a cache, so it cannot see a
compressor. :class:`CompressedKVLM` instead splits each prompt into a **context** and a **query**
(:meth:`CompressedKVLM.prompt`) and, for each request,

1. prefills the context once, with a plain 16-bit cache;
2. loads that KV into a :class:`~kvbench.cache.compressed.CompressedCache` (the compressor codes it; the bytes are
   all that is kept) and, on identical terms, into the uncompressed 16-bit baseline cache;
3. feeds the query on top of each cache, uncompressed, then ``loglikelihood``: scores the continuation after it;
   ``generate_until``: generates greedily, every new token held 16-bit too.

Two protocols decide where the split falls:

* ``context_only`` (the default; the protocol of kvpress and of the papers it reproduces, SnapKV, KVzip, expected
  attention): the context is the document the question is about, the query is the question and the answer prefix
  (a task row's ``query`` field). The compressor never sees the question: an eviction method's observation window
  is the context's tail, a quantizer leaves the question 16-bit. The cache codes the context once and holds
  everything after it 16-bit (``mode="once"``), as kvpress applies its press during the context's prefill only.
  A task without a separable question (``query`` absent) has only its prompt's last token as the query.
* ``query_aware`` (the earlier behaviour): everything but the prompt's last token is compressed, question included.

The prefill is shared, so the baseline costs only the query and scoring passes; and the baseline's results do not
depend on the compressor, so a process keeps them (:data:`BASELINES`) and a sweep of eval cells in one process runs
each request's baseline once. With a :class:`~kvbench.measure.evaluation.prefill_store.PrefillStore` (``paths.prefills``)
the context's prefill and the baseline's results are kept across processes too: a later cell loads the context's KV
and the baseline's answer instead of computing them. The compressed results go back to lm-eval; the baseline's are kept for
:class:`ReplayLM`, which hands them to a second lm-eval pass over the same requests, so both sets of metrics come
from lm-eval's own metric code on identical examples.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import LM
from tqdm import tqdm
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from kvbench.cache.compressed import CompressedCache
from kvbench.core.checks import check_choice
from kvbench.core.compressor import Compressor
from kvbench.inputs.models import model_identity
from kvbench.measure.evaluation.prefill_store import PrefillStore

PROTOCOLS = ("context_only", "query_aware")
#: the baseline's result of each request, by (model, device, cache dtype, protocol, prompt tokens, request): the
#: same whatever the compressor (a model built in the process is never kept: its weights have no name)
BASELINES: dict[tuple, Any] = {}


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids: ``context`` is compressed, ``query`` (never empty) is fed on top of it, 16-bit."""

    context: list[int]
    query: list[int]


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
    """Scores requests with ``compressor`` and with the 16-bit baseline, sharing each context's prefill."""

    def __init__(self, handle: Any, compressor: Compressor, *, protocol: str = "context_only", residual: int | None = 0,
                 chunk: int = 128, mode: str = "auto", dtype: torch.dtype = torch.float16, progress: bool = True,
                 store: PrefillStore | None = None) -> None:
        super().__init__()
        check_choice("eval", "protocol", protocol, PROTOCOLS)
        if protocol == "context_only" and mode == "chunked":
            raise ValueError("protocol=context_only codes the context once and holds the query and the answer 16-bit; "
                             "cache.mode=chunked would code them too: use cache.mode=auto or once, or protocol=query_aware")
        self.handle, self.compressor, self.protocol = handle, compressor, protocol
        self.cache_kw = {"residual": residual, "chunk": chunk, "mode": "once" if protocol == "context_only" else mode,
                         "dtype": dtype}
        self.progress = progress
        # a model built in this process has no name to key stored prefills by
        self.store = store if self.model_id() is not None else None
        self.model, self.tok = handle.model, handle.tokenizer
        self._device = next(self.model.parameters()).device
        cfg = self.model.config.get_text_config(decoder=True)
        self.max_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.kv_elements_per_token = 2 * cfg.num_hidden_layers * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * (
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eos = self.tok.eos_token_id
        self.baseline: dict[tuple, Any] = {}
        self.accounting = defaultdict(float)
        #: (task name, doc id) -> (context tokens, query tokens) of the requests seen
        self.shapes: dict[tuple[str | None, int | None], tuple[int, int]] = {}

    @property
    def cache_compressor(self) -> Compressor:
        """The compressor as the cache runs it (a compressor's own ``residual`` window is handed to the cache)."""
        return self.cache(self.compressor).compressor

    # ------------------------------------------------------------------ the steps of one request
    def _enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def prompt(self, text: str, doc: Any = None, room: int = 0) -> Prompt:
        """``text`` split into context and query by the protocol, the context cut from the left so that the whole
        prompt and ``room`` more tokens fit the model.

        Under ``context_only`` a ``doc`` with a ``query`` that ``text`` ends with is split there: the tokens of the
        whole text after the context's own tokens are the query (the query's own tokens, where the tokenizer merges
        across the boundary). Otherwise the last token is the query.
        """
        query = doc.get("query") if self.protocol == "context_only" and isinstance(doc, dict) else None
        q = str(query or "").rstrip()
        whole = self._enc(text) or [self.eos]
        if q and text.rstrip().endswith(q) and len(text.rstrip()) > len(q):
            head = text.rstrip()[: -len(q)]
            ctx = self._enc(head)
            ids = whole[len(ctx):] if whole[: len(ctx)] == ctx else self._enc(text[len(head):])
        else:
            ctx, ids = whole[:-1], whole[-1:]
        keep = self.max_length - room - len(ids)
        if keep < 0:
            raise ValueError(f"the query ({len(ids)} tokens) and {room} more do not fit the model's {self.max_length}")
        return Prompt(ctx[len(ctx) - keep:] if len(ctx) > keep else ctx, ids)

    def cache(self, compressor: Compressor | None) -> CompressedCache:
        """An empty cache of this evaluation (``None``: the 16-bit baseline, same arithmetic)."""
        # accuracy depends on the decoded values only: each segment is decoded once from its bytes, not per token
        return CompressedCache(compressor, model=self.handle, hold="decoded", **self.cache_kw)

    @torch.no_grad()
    def caches(self, prompt: Prompt, baseline: bool = True) -> tuple[CompressedCache, CompressedCache | None]:
        """The context prefilled once in 16 bits (or its prefill loaded from the store), loaded into the compressed
        cache and (``baseline``) into the baseline's."""
        prefill = DynamicCache()  # full layers only: sliding-window layers keep every token, as in capture
        stored = self.store.kv(prompt.context) if self.store is not None and prompt.context else None
        if stored is not None:
            for i, (k, v) in enumerate(stored):  # each (1, H, T, D)
                prefill.update(k.to(self._device), v.to(self._device), i)
            self.accounting["stored_prefills"] += 1
        elif prompt.context:
            self.model(torch.tensor([prompt.context], device=self._device), cache=prefill, use_cache=True, logits_to_keep=1)
            if self.store is not None:
                self.store.put_kv(prompt.context, [(layer.keys, layer.values) for layer in prefill.layers])
        comp = self._load(self.compressor, prefill, prompt.context)
        return comp, self._load(None, prefill, prompt.context) if baseline else None

    def model_id(self) -> tuple | None:
        """The model's name and path as the run's config gives them; None for a model built in this process."""
        return model_identity(self.handle)

    def memo_key(self, kind: str, prompt: Prompt, *request: Any) -> tuple | None:
        """Where :data:`BASELINES` (and the store) keep a request's baseline result; None for a model built in this
        process."""
        model = self.model_id()
        if model is None:
            return None
        return (model, str(self._device), str(self.cache_kw["dtype"]), self.protocol, kind, tuple(prompt.context),
                tuple(prompt.query), *request)

    def known(self, key: tuple | None) -> bool:
        """Whether the baseline's result of ``key`` is kept, in this process or in the store."""
        if key is None:
            return False
        if key not in BASELINES and self.store is not None:
            found, got = self.store.answer(key)
            if found:
                BASELINES[key] = got
        return key in BASELINES

    def keep(self, key: tuple | None, result: Any) -> None:
        if key is not None:
            if key not in BASELINES and self.store is not None:
                self.store.put_answer(key, result)
            BASELINES[key] = result

    def _load(self, compressor: Compressor | None, prefill: DynamicCache, ids: list[int]) -> CompressedCache:
        cache = self.cache(compressor)
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
    def score(self, cache: CompressedCache, query: list[int], cont: list[int]) -> tuple[float, bool]:
        """``(log-likelihood of cont, greedy)`` with ``query + cont[:-1]`` fed on a copy of ``cache``."""
        c = cache.clone()
        before = c.stats()["decode_s"]
        inp = torch.tensor([[*query, *cont[:-1]]], device=self._device)
        logits = self.model(inp, cache=c, use_cache=True, logits_to_keep=len(cont)).logits[0].float()  # (n, V)
        if cache.compressor is not None:
            self.accounting["decode_s"] += c.stats()["decode_s"] - before
        target = torch.tensor(cont, device=self._device)
        logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        return float(logp.sum()), bool((logits.argmax(-1) == target).all())

    def generate(self, cache: CompressedCache, prompt: Prompt, max_new: int, until: list[str], desc: str = "generate") -> str:
        """Greedy text after ``prompt`` on ``cache`` (which holds its context), cut at the first stop string."""
        ctx = [*prompt.context, *prompt.query]
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

    def _note(self, req: Any, prompt: Prompt) -> None:
        self.shapes[(getattr(req, "task_name", None), getattr(req, "doc_id", None))] = (len(prompt.context), len(prompt.query))

    # ------------------------------------------------------------------ lm-eval API
    def _encode_pair(self, context: str, continuation: str) -> tuple[str, list[int]]:
        """As lm-eval's HFLM: trailing spaces of the context move to the continuation, whose tokens are those of
        the joint text after the context's; returns the context text and the continuation's tokens."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self._enc(context) or [self.eos]
        whole = self._enc(context + continuation)
        return context, whole[len(ctx):] if whole[: len(ctx)] == ctx else self._enc(continuation)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, tuple, list[int]]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, cont = self._encode_pair(*req.args)
            if not cont:
                raise ValueError(f"empty continuation after tokenization for request {req.args!r}")
            p = self.prompt(context, getattr(req, "doc", None), room=len(cont))
            groups[(tuple(p.context), tuple(p.query))].append((i, req.args, cont))  # one prefill per prompt
            self._note(req, p)
        out: list[Any] = [None] * len(requests)
        for (ctx, query), items in (_bar(groups.items(), desc="loglikelihood") if self.progress else groups.items()):
            p = Prompt(list(ctx), list(query))
            keys = [self.memo_key("ll", p, tuple(cont)) for _, _, cont in items]
            comp, base = self.caches(p, baseline=not all(self.known(k) for k in keys))
            for (i, args, cont), key in zip(items, keys):
                out[i] = self.score(comp, p.query, cont)
                got = BASELINES[key] if self.known(key) else self.score(base, p.query, cont)
                self.baseline[("ll", *args)] = got
                self.keep(key, got)
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
            p = self.prompt(context, getattr(req, "doc", None), room=max_new)
            self._note(req, p)
            key = self.memo_key("gen", p, max_new, tuple(until))
            comp, base = self.caches(p, baseline=not self.known(key))
            out.append(self.generate(comp, p, max_new, until, "compressed"))
            got = BASELINES[key] if self.known(key) else self.generate(base, p, max_new, until, "baseline")
            self.baseline[_gen_key(context, req.args[1])] = got
            self.keep(key, got)
        return out

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
