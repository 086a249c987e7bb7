"""Why a lossy cache can score a lower NLL than the 16-bit one: a diagnosis on the windows a run scored.

    python scripts/diagnose_loss_below_base.py [--windows 4] [--out results/loss_below_base.json] [OVERRIDE ...]

Default: KVQuant 3-bit on qwen25_coder_05b (``model=qwen25_coder_05b +compressor=kvquant compressor.bits=3``), whose
delta NLL is negative on the frontier's test windows. For each of the first ``--windows`` evaluated windows of the
run's trace it scores the held-out continuation (per-token mean NLL, nats) with

- the 16-bit cache as captured, and the same cache captured in float32 (is the 16-bit baseline itself degraded?);
- the 16-bit cache with RoPE undone and applied again (the pre-RoPE path every pre-RoPE coder takes, at the model's
  own RoPE base);
- the 16-bit cache with the output logits divided by a temperature (is the model overconfident on this text? a
  temperature above 1 then lowers the NLL too);
- the decoded cache, its keys alone and its values alone (which half carries the change);
- the 16-bit cache plus Gaussian noise of the decoded cache's per-layer error energy (does any error of that size
  lower the NLL, or only this coder's?);

and the next-token distribution's entropy with the 16-bit and the decoded cache. The exact cache forced through the
compressed path (``metrics.reuse_exact_nll=false`` with ``+compressor=identity``) scoring a delta NLL of exactly 0 is
a test (tests/test_base_nlls.py), so a difference here is the decoded cache's, not the scoring's. Writes one JSON
with every window's figures, their means and the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvbench.coding.bitstream import Bitstream
from kvbench.core.codec import prepare
from kvbench.core.config import compose, make_compressor
from kvbench.core.items import Item, coding_contexts
from kvbench.core.kv import KVSequence
from kvbench.core.machine import conditions
from kvbench.core.rope import Rotary
from kvbench.inputs.capture import capture_window, load_or_capture
from kvbench.inputs.models import ModelHandle
from kvbench.measure.metrics.task_loss import build_cache
from kvbench.store.atomic import write_json
from kvbench.store.results import git_sha

DEFAULT = ["model=qwen25_coder_05b", "+compressor=kvquant", "compressor.bits=3"]
TEMPERATURES = (0.95, 1.05, 1.1)


@torch.no_grad()
def continuation_logits(model, kv: KVSequence, cont: torch.Tensor) -> torch.Tensor:
    """``(E, V)`` logits of ``cont[1:]`` after the prefix cache ``kv`` and ``cont[:-1]``, as the harness scores them."""
    return model(cont[:-1].unsqueeze(0), cache=build_cache(model, kv), use_cache=True).logits[0].float()


def nll(logits: torch.Tensor, cont: torch.Tensor, temperature: float = 1.0) -> float:
    return float(torch.nn.functional.cross_entropy(logits / temperature, cont[1:]))


def entropy(logits: torch.Tensor) -> float:
    return float(torch.distributions.Categorical(logits=logits).entropy().mean())


def with_noise(x: torch.Tensor, x_hat: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``x`` plus Gaussian noise of ``x_hat - x``'s energy in each layer, in ``x``'s dtype."""
    err = (x_hat.float() - x.float()).pow(2).sum((1, 2, 3), keepdim=True)  # (L, 1, 1, 1)
    z = torch.randn(x.shape, generator=g)  # (L, H, T, D)
    return (x.float() + z * (err / z.pow(2).sum((1, 2, 3), keepdim=True)).sqrt()).to(x.dtype)


def diagnose(cfg, windows: int) -> dict:
    handle = ModelHandle(cfg.model, cfg.device)
    trace = load_or_capture(cfg, handle)
    compressor = make_compressor(cfg.compressor)
    codec = prepare(compressor, lambda: [s.kv for s in trace.calib], cfg.device, None, handle.config)
    rope, model, g = Rotary(handle.config), handle.model, torch.Generator().manual_seed(int(cfg.seed))
    rows = []
    for s in trace.eval[:windows]:
        kv, cont, T = s.kv, s.continuation, s.kv.n_tokens
        enc, dec = coding_contexts([Item(kv, T, cont)], handle if compressor.needs_model else None, handle.config)
        kv_hat = codec.decoder.decode(Bitstream.from_bytes(codec.encoder.encode(kv, enc[0]).data), dec[0])
        fp32 = capture_window(model, torch.cat([kv.tokens, cont]), T, torch.float32)
        exact = continuation_logits(model, kv, cont)
        decoded = continuation_logits(model, kv_hat, cont)
        row = {"exact_16bit": nll(exact, cont),
               "exact_float32": nll(continuation_logits(model, KVSequence(fp32["k"], fp32["v"], kv.tokens), cont), cont),
               "rope_undone_and_applied": nll(continuation_logits(
                   model, KVSequence(rope.apply(rope.undo(kv.k.float(), 0), 0).to(kv.k.dtype), kv.v, kv.tokens), cont), cont),
               **{f"exact_temperature_{t:g}": nll(exact, cont, t) for t in TEMPERATURES},
               "decoded": nll(decoded, cont),
               "decoded_keys_only": nll(continuation_logits(model, KVSequence(kv_hat.k, kv.v, kv.tokens), cont), cont),
               "decoded_values_only": nll(continuation_logits(model, KVSequence(kv.k, kv_hat.v, kv.tokens), cont), cont),
               "gaussian_noise_same_error": nll(continuation_logits(
                   model, KVSequence(with_noise(kv.k, kv_hat.k, g), with_noise(kv.v, kv_hat.v, g), kv.tokens), cont), cont),
               "entropy_exact": entropy(exact), "entropy_decoded": entropy(decoded)}
        rows.append(row)
        print({k: round(v, 5) for k, v in row.items()}, file=sys.stderr, flush=True)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    return {"model": cfg.model.name, "compressor": compressor.name, "compressor_params": compressor.describe(),
            "dataset": cfg.dataset.name, "windows": windows, "documents": trace.manifest.get("documents", [])[:windows],
            "mean": mean, "delta_vs_exact": {k: v - mean["exact_16bit"] for k, v in mean.items() if k.startswith(
                ("exact_", "rope_", "decoded", "gaussian"))}, "per_window": rows, "git_sha": git_sha(), **conditions()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("results/loss_below_base.json"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config (default: " + " ".join(DEFAULT) + ")")
    args = p.parse_args(argv)
    cfg = compose(args.overrides or DEFAULT)
    got = diagnose(cfg, args.windows)
    write_json(args.out, got)
    print(json.dumps(got["delta_vs_exact"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
