"""Each evaluation example's 16-bit context prefill and the baseline's answer, kept under ``KVBENCH_HOME`` so that a
compressed cell costs only what the compressor changes.

Under the context-only protocol every cell of an evaluation prefills the same contexts with the same model, and the
16-bit baseline answers the same questions: neither depends on the compressor. A process already answers each
baseline once (:data:`kvbench.measure.evaluation.lm.BASELINES`); this store keeps both across processes, keyed like
traces (the capture code's version, which names the torch, transformers and interpreter versions, and the model, the
cache dtype and the device), one file per context and one per answer:

- ``kv-<hash of the context's tokens>.safetensors``: every layer's keys and values in the cache dtype, which is all
  the caches keep of them (:meth:`kvbench.cache.compressed.CompressedCache.load` stores them in that dtype), with the
  tokens they are of and the dtype the model computed them in;
- ``answer-<hash of the request>.json``: the baseline's result, sealed with its hash, with the request it answers.

A compressed cell then loads the context's KV, codes it, prefills the question and generates the answer; the first
cell over a set of examples fills the store. A damaged file is an error naming it (delete it; the next run computes
it again), never a silent recomputation: a wrong cached answer would move every cell's paired score alike.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from kvbench.store.atomic import write_bytes, write_json
from kvbench.store.integrity import damaged, read_sealed_json, seal
from kvbench.store.paths import home

#: how to rebuild an entry of the store
REBUILD = "delete the file; the next evaluation prefills the context (or answers the request) again"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _tensor_hash(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class PrefillStore:
    """The store of one (model, cache dtype, device, capture code): :meth:`kv` and :meth:`answer` read an entry
    (None when absent), :meth:`put_kv` and :meth:`put_answer` write one atomically."""

    def __init__(self, folder: Path, dtype: torch.dtype) -> None:
        self.folder, self.dtype = Path(folder), dtype

    @classmethod
    def for_model(cls, model: tuple, dtype: torch.dtype, device: str, root: Path | None = None) -> PrefillStore:
        """The store of ``model`` (its name and path, as the run's config names it) under ``root`` (default
        ``KVBENCH_HOME/prefills``)."""
        from kvbench.inputs.capture import capture_code_version
        from kvbench.inputs.models import in_file_name

        key = _digest({"code": capture_code_version(), "model": list(model), "dtype": str(dtype), "device": device})
        name = "-".join(in_file_name(m) for m in model[:1])
        return cls((root or home() / "prefills") / f"{name}-{key[:16]}", dtype)

    # ------------------------------------------------------------------ the context's KV
    def _kv_file(self, context: list[int]) -> Path:
        return self.folder / f"kv-{_digest(list(context))}.safetensors"

    def kv(self, context: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer's ``(k, v)``, each ``(1, H, T, D)`` in the dtype the model computed them in, of ``context``;
        None when the store has none."""
        f = self._kv_file(context)
        if not f.exists():
            return None
        try:
            raw = f.read_bytes()
            tensors = load(raw)
            # safetensors' header: its length (8 bytes, little-endian), then JSON whose __metadata__ holds ours
            meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")]).get("__metadata__", {})
        except (SafetensorError, ValueError, OSError) as e:
            raise damaged(f, f"is not a readable prefill ({type(e).__name__}: {e})", REBUILD) from e
        if meta.get("sha256") != _tensor_hash(tensors):
            raise damaged(f, "fails its content hash", REBUILD)
        if tensors["tokens"].tolist() != list(context):
            raise damaged(f, "holds the prefill of another context", REBUILD)
        compute = getattr(torch, meta.get("compute_dtype", "float32"))
        n = int(meta["layers"])
        return [(tensors[f"k.{i}"].to(compute), tensors[f"v.{i}"].to(compute)) for i in range(n)]

    def put_kv(self, context: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``layers`` (every layer's ``(k, v)`` as the model computed them) of ``context``, in the cache dtype."""
        tensors = {"tokens": torch.tensor(list(context), dtype=torch.int64)}
        for i, (k, v) in enumerate(layers):
            tensors[f"k.{i}"] = k.detach().to("cpu", self.dtype).contiguous()
            tensors[f"v.{i}"] = v.detach().to("cpu", self.dtype).contiguous()
        compute = str(layers[0][0].dtype).removeprefix("torch.")
        meta = {"sha256": _tensor_hash(tensors), "layers": str(len(layers)), "compute_dtype": compute}
        write_bytes(self._kv_file(context), save(tensors, metadata=meta))

    # ------------------------------------------------------------------ the baseline's answers
    def _answer_file(self, request: tuple) -> Path:
        return self.folder / f"answer-{_digest(list(request))}.json"

    def answer(self, request: tuple) -> tuple[bool, Any]:
        """``(found, result)`` of the baseline for ``request`` (a loglikelihood's ``(logp, greedy)`` comes back as a
        tuple, a generation as its text)."""
        f = self._answer_file(request)
        if not f.exists():
            return False, None
        body = read_sealed_json(f, REBUILD)
        if body.get("request") != json.loads(json.dumps(list(request), default=str)):
            raise damaged(f, "answers another request", REBUILD)
        got = body.get("result")
        return True, tuple(got) if isinstance(got, list) else got

    def put_answer(self, request: tuple, result: Any) -> None:
        write_json(self._answer_file(request), seal({"request": list(request), "result": result}))

