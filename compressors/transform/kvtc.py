"""KVTC: transform coding of the KV cache (Staniszewski & Łańcucki, "KV Cache Transform Coding for Compact Storage
in LLM Inference", arXiv 2511.01815).

The paper's pipeline, as implemented here (keys and values each have their own basis and codes):

1. **Decorrelation by calibrated PCA.** Keys have RoPE undone first (:mod:`kvbench.core.rope`, from the model config and
   positions, both free), so that a token's key no longer rotates with its position. Each token's vectors of all
   KV heads are concatenated and centred by a calibration mean, then projected on principal axes fitted once on
   calibration windows. ``pca_scope`` says which vectors share a basis:

   - ``layer``: one basis per layer over its heads (dimension H·D);
   - ``global``: one basis over H·D shared by every layer (layers are extra samples; means and the bit allocation
     stay per layer);
   - ``concat``: one basis over all layers' heads concatenated (dimension L·H·D), the paper's setting. With few
     calibration tokens it has at most as many axes as calibration tokens.

   ``rank`` truncates the basis (default: every axis the calibration supports).
2. **Bit allocation by dynamic programming.** Every principal component (per layer where the scope keeps layers
   apart) gets a width w in 0..8; the widths of K and V together sum to at most ``bits`` per KV element, and the
   DP (:func:`allocate_dp`) makes the calibration error least: the squared error of the quantizer at each width,
   measured on the calibration coefficients, relative to the energy of its kind (K or V), the keys' weighted by
   ``key_weight``. Width 0 drops the component. ``allocation=uniform`` gives every component the same width
   instead, for comparison.
3. **Quantization and entropy coding.** A component of width w is quantized uniformly with step ``σ · Δ_w``
   (``σ``: its calibration standard deviation; ``Δ_w``: the step at which a unit-variance calibration coefficient
   has an entropy of w bits) and reconstructed at the centre of its bin; its integer symbols are range-coded
   (constriction, through :mod:`kvbench.coding.entropy`) under the histogram fitted on calibration for that width.
   Width w therefore costs about w stored bits per coefficient, and ``bits`` is about the stored rate of the
   transform-coded tokens.
4. **Attention sinks and the recent window** (the first ``sinks`` positions of the sequence and its last
   ``window`` tokens) are stored exactly, 16 bits per element.

Choices the paper leaves open or that differ from it:

- The quantizer uses a fixed step per component from calibration rather than per-token scales and shifts: with an
  entropy coder behind it a fixed step is the better choice for squared error, and it needs no side information.
- The DP chooses one width per component, not per group of components and quantization type; its budget counts
  about the entropy-coded bits (width w is calibrated to cost w bits), not fixed-length codes.
- One budget for K and V, split by the DP. Relative errors, because raw squared error would hand the bits to
  whichever kind has the larger values. ``key_weight`` defaults to 0.25: on SmolLM2-135M (SOTU and Moby-Dick
  windows) keys tolerate far larger relative errors than values: at 1 bit per element weights of 0.1-0.25 lost
  0.03-0.06 nats of NLL where equal weights lost 0.16-0.19; at 2 bits every weight in 0.1-1 was within noise.
- The entropy coder is a range coder under fitted histograms instead of DEFLATE (nvCOMP); the basis comes from an
  exact eigendecomposition, not randomized SVD; calibration uses every calibration token after the sinks (the
  windows' last tokens are ordinary text there, so they are kept as data). Coefficients beyond ``Z_CLIP``
  calibration standard deviations are clipped.

Codec state (:meth:`Kvtc.state`, charged once per run): per kind the means (float16), the kept basis columns
(float16), the widths (4 bits each), the kept components' σ (float16), the steps Δ_w (float32) and the histograms
(16-bit frequencies). The encoder codes with the state as parsed back from those bytes, so both sides use the very
same numbers.

Calibration keys come from ``fit(calib, config=...)`` with RoPE undone at positions from 0 (calibration windows start
a sequence), or from pre-RoPE keys captured with the windows (``capture.pre_rope=true``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kvbench.coding.bitstream import Bitstream, BitstreamError, read_varints, varints
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import pack_codes, tensor_from_bytes, tensor_to_bytes, unpack_codes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Section
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary

SCOPES = ("layer", "global", "concat")
ALLOCATIONS = ("dp", "uniform")
KINDS = ("k", "v")
#: widths the allocation chooses from: 0 (dropped) .. MAX_WIDTH bits per coefficient
MAX_WIDTH = 8
#: coefficients are clipped at this many calibration standard deviations
Z_CLIP = 16.0
#: histogram frequencies are stored on this many bits (every symbol in range keeps a frequency of at least 1)
FREQ_BITS = 16
#: calibration coefficients used to find the entropy-calibrated steps (a subsample: enough for 8 bits of entropy)
_STEP_SAMPLES = 1 << 19


# ---- allocation -----------------------------------------------------------------------------------------------


def allocate_dp(distortion: np.ndarray, budget: int) -> np.ndarray:
    """Widths ``w_i`` in ``0..W`` minimising ``sum_i distortion[i, w_i]`` subject to ``sum_i w_i <= budget``.

    ``distortion`` is ``(n, W + 1)``: the error of item i at each width (``W <= 15``). Exact dynamic programming over
    the budget (the knapsack recursion ``f_i(β) = min_w f_{i-1}(β - w) + D_i(w)``), vectorised over β; ties go to
    the narrower width. Time ``n · W · budget``; the choices are kept at 4 bits each, ``n · budget / 2`` bytes.
    """
    dist = np.asarray(distortion, dtype=np.float64)
    if dist.ndim != 2 or not 1 <= dist.shape[1] <= 16:
        raise ValueError(f"distortion must be (items, widths + 1) with at most 16 widths; got shape {dist.shape}")
    n, n_w = dist.shape
    if budget < 0:
        raise ValueError(f"bit budget must be >= 0, got {budget}")
    budget = int(min(budget, (n_w - 1) * n))
    f = np.zeros(budget + 1)  # best total error of the items so far with at most β bits
    choice = np.zeros(((n + 1) // 2, budget + 1), dtype=np.uint8)  # two items per byte, low nibble first
    cand = np.empty((n_w, budget + 1))
    for i in range(n):
        cand.fill(np.inf)
        for w in range(min(n_w, budget + 1)):
            np.add(f[: budget + 1 - w], dist[i, w], out=cand[w, w:])
        best = cand.argmin(axis=0).astype(np.uint8)
        choice[i // 2] |= best << np.uint8(4 * (i % 2))
        f = np.take_along_axis(cand, best[None].astype(np.intp), axis=0)[0]
    widths = np.zeros(n, dtype=np.int64)
    left = budget
    for i in range(n - 1, -1, -1):
        widths[i] = (int(choice[i // 2, left]) >> (4 * (i % 2))) & 0xF
        left -= widths[i]
    return widths


def allocate_uniform(variance: np.ndarray, budget: int, max_width: int = MAX_WIDTH) -> np.ndarray:
    """The same width for every component (``budget // n``), the remainder one bit each to the largest ones."""
    var = np.asarray(variance, dtype=np.float64).reshape(-1)
    n = var.size
    base = min(max_width, budget // max(n, 1))
    widths = np.full(n, base, dtype=np.int64)
    extra = min(budget - base * n, n) if base < max_width else 0
    widths[np.argsort(-var, kind="stable")[:extra]] += 1
    return widths


# ---- calibration helpers --------------------------------------------------------------------------------------


def _eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # A few hundred dimensions: one thread is several times faster than two fighting for a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.eigh(a)
    finally:
        torch.set_num_threads(threads)


def principal_axes(x: torch.Tensor, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal axes of centred samples ``x`` ``(N, d)``: ``(variances (r,), axes (d, r))``, largest first.

    Uses the covariance when ``N >= d`` and the Gram matrix otherwise (then at most N axes exist), in float64.
    """
    x = x.double()
    n, d = x.shape
    if n >= d:
        var, axes = _eigh(x.T @ x / n)  # (d,), (d, d), ascending
        var, axes = var.flip(0), axes.flip(1)
    else:
        var, u = _eigh(x @ x.T / n)  # (N,), (N, N)
        var, u = var.flip(0), u.flip(1)
        keep = var > var[0].clamp_min(1e-300) * 1e-12
        var, u = var[keep], u[:, keep]
        axes = x.T @ u / torch.sqrt(var * n)  # (d, r): the right singular vectors
    var = var.clamp_min(0)
    r = axes.shape[1] if rank is None else min(rank, axes.shape[1])
    return var[:r], axes[:, :r]


def _entropy_bits(z: np.ndarray, step: float) -> float:
    q = np.rint(z / step).astype(np.int64)
    counts = np.bincount(q - q.min())
    p = counts[counts > 0] / z.size
    return float(-(p * np.log2(p)).sum())


def calibrated_steps(z: np.ndarray, max_width: int = MAX_WIDTH) -> np.ndarray:
    """``(max_width,)`` steps ``Δ_w`` (w = 1..max_width) at which ``round(z / Δ_w)`` has an entropy of w bits, for
    unit-variance calibration coefficients ``z``; found by bisection on ``log2 Δ`` (the entropy falls as Δ grows)."""
    z = np.asarray(z, dtype=np.float64).reshape(-1)
    if z.size < 2:
        raise ValueError("kvtc: too few calibration coefficients to calibrate the quantizer steps")
    steps = np.empty(max_width)
    for w in range(1, max_width + 1):
        lo, hi = -16.0, 8.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if _entropy_bits(z, 2.0**mid) > w:
                lo = mid
            else:
                hi = mid
        steps[w - 1] = 2.0 ** (0.5 * (lo + hi))
    return steps


def _half_range(step: float) -> int:
    """Largest symbol magnitude at a normalized step (coefficients are clipped at ``Z_CLIP`` standard deviations)."""
    return max(1, math.ceil(Z_CLIP / step))



# ---- layout -----------------------------------------------------------------------------------------------------


def _columns(x: torch.Tensor, scope: str) -> torch.Tensor:
    """``(L, H, T, D)`` -> ``(U, d, T)``: one column of all heads per token, per layer (or all layers for concat)."""
    L, H, T, D = x.shape
    cols = x.permute(0, 1, 3, 2).reshape(L, H * D, T)  # (L, H*D, T)
    return cols.reshape(1, L * H * D, T) if scope == "concat" else cols


def _uncolumns(cols: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Inverse of :func:`_columns`: ``(U, d, T)`` -> ``(L, H, T, D)``."""
    L, H, T, D = shape
    return cols.reshape(L, H, D, T).permute(0, 1, 3, 2)


@dataclass
class _Fitted:
    """One kind's calibration analysis, before the allocation."""

    mean: torch.Tensor  # (U, d) float16
    basis: torch.Tensor  # (G, d, r) float16
    coef: np.ndarray  # (U, r, N) float32 calibration coefficients
    sigma: np.ndarray  # (U, r) float64 (float16 values), 0 for dead components
    steps: np.ndarray  # (MAX_WIDTH,) float64 (float32 values)
    dist: np.ndarray  # (U, r, MAX_WIDTH + 1) mean squared error per token at each width
    energy: float  # mean squared norm of a unit's vector (for relative errors)


@dataclass
class _KindCodec:
    """What the decoder of one kind (K or V) holds, parsed from the state bytes."""

    mean: torch.Tensor  # (U, d) float32
    basis: torch.Tensor  # (G, d, R) float32, zero columns past each basis's kept rank
    widths: np.ndarray  # (U, R) int64
    sigma: np.ndarray  # (U, R) float64, 0 where the width is 0
    steps: np.ndarray  # (MAX_WIDTH,) normalized steps Δ_w
    freqs: dict[int, np.ndarray]  # width -> (2K_w + 1,) histogram frequencies
    # derived once: kept rows of the (U*R, T) coefficient matrix, grouped by width
    order: np.ndarray = field(init=False)  # (n_kept,) row indices, by width then row
    row_step: np.ndarray = field(init=False)  # (n_kept,) float32 quantizer step of each kept row
    row_inv_step: np.ndarray = field(init=False)  # (n_kept,) float32
    row_half: np.ndarray = field(init=False)  # (n_kept,) float32 largest symbol magnitude of each kept row
    groups: list[tuple[int, int, int]] = field(init=False)  # (width, first, stop) slices of order
    probs: dict[int, np.ndarray] = field(init=False)  # width -> normalized histogram

    def __post_init__(self) -> None:
        flat_w = self.widths.reshape(-1)
        order = np.argsort(flat_w, kind="stable")
        self.order = order[flat_w[order] > 0]
        w = flat_w[self.order]
        step = self.sigma.reshape(-1)[self.order] * self.steps[w - 1]
        self.row_step = step.astype(np.float32)
        self.row_inv_step = (1.0 / step).astype(np.float32)
        halves = np.array([0] + [_half_range(float(s)) for s in self.steps], dtype=np.float32)
        self.row_half = halves[w]
        self.groups = []
        for width in range(1, MAX_WIDTH + 1):
            lo, hi = np.searchsorted(w, width, "left"), np.searchsorted(w, width, "right")
            if hi > lo:
                self.groups.append((width, int(lo), int(hi)))
        self.probs = {width: f / f.sum() for width, f in ((k, v.astype(np.float64)) for k, v in self.freqs.items())}


@dataclass
class Kvtc(Compressor):
    """KV cache transform coding (arXiv 2511.01815): calibrated PCA (keys with RoPE undone), DP bit allocation,
    uniform quantization and entropy coding; sinks and the recent window exact."""

    bits: float = 2.0
    rank: int | None = None
    sinks: int = 4
    window: int = 128
    pca_scope: str = "layer"
    allocation: str = "dp"
    key_weight: float = 0.25
    undo_rope: bool = True

    name: ClassVar[str] = "kvtc"
    needs_config: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise ValueError(f"kvtc.bits={self.bits!r} must be a number of bits per element in [0, {MAX_WIDTH}]")
        check_range("kvtc", "bits", self.bits, 0, MAX_WIDTH)
        if self.rank is not None:
            check_range("kvtc", "rank", self.rank, 1, 1 << 24, integer=True)
            self.rank = int(self.rank)
        check_range("kvtc", "sinks", self.sinks, 0, 1 << 24, integer=True)
        check_range("kvtc", "window", self.window, 0, 1 << 24, integer=True)
        check_choice("kvtc", "pca_scope", self.pca_scope, SCOPES)
        check_choice("kvtc", "allocation", self.allocation, ALLOCATIONS)
        if isinstance(self.key_weight, bool) or not isinstance(self.key_weight, (int, float)):
            raise ValueError(f"kvtc.key_weight={self.key_weight!r} must be a positive number")
        check_range("kvtc", "key_weight", self.key_weight, 1e-6, 1e6)
        if not isinstance(self.undo_rope, bool):
            raise ValueError(f"kvtc.undo_rope={self.undo_rope!r} must be true or false")
        self.bits, self.sinks, self.window = float(self.bits), int(self.sinks), int(self.window)
        self.key_weight = float(self.key_weight)
        self._codecs: dict[str, _KindCodec] = {}
        self._state: dict[str, Section] = {}
        self._rotary: tuple[Any, Rotary] | None = None

    # ---- fitting ------------------------------------------------------------------------------------------------

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        """Fit means, bases, steps, widths and histograms on calibration windows (each starting at position 0).

        Keys need RoPE undone: with ``config`` (the model's config) it is undone here; otherwise the windows must
        carry pre-RoPE keys (``capture.pre_rope=true``), unless ``undo_rope`` is false.
        """
        calib = list(calib)
        if not calib:
            raise ValueError("kvtc.fit needs at least one calibration sequence")
        shapes = {kv.shape[:2] + kv.shape[3:] for kv in calib}
        if len(shapes) != 1:
            raise ValueError(f"kvtc.fit: calibration sequences have different (layers, heads, head_dim): {sorted(shapes)}")
        L, H, _, D = calib[0].shape
        fitted = {}
        for kind in KINDS:
            cols = [_columns(self._calib_kind(kv, kind, config)[:, :, min(self.sinks, kv.n_tokens):], self.pca_scope)
                    for kv in calib]  # each (U, d, T_i)
            x = torch.cat(cols, dim=2).double()  # (U, d, N)
            if x.shape[2] < 2:
                raise ValueError(f"kvtc.fit: {x.shape[2]} calibration tokens after the {self.sinks} sinks; need >= 2")
            fitted[kind] = self._analyse(x)
        widths = self._allocate(fitted, L * H * D)
        sections: dict[str, Section] = {}
        for kind, f in fitted.items():
            sections.update(self._sections(kind, f, widths[kind]))
        self.load_state(sections)

    def _calib_kind(self, kv: KVSequence, kind: str, config: Any) -> torch.Tensor:
        if kind == "v":
            return kv.v.float()
        if not self.undo_rope:
            return kv.k.float()
        if config is not None:
            return self._rotary_for(config).undo(kv.k, 0)
        if kv.k_pre_rope is not None:
            return kv.k_pre_rope.float()
        raise ValueError("kvtc.fit needs the model config to undo RoPE on the calibration keys: call "
                         "fit(calib, config=model_config), capture the calibration windows with capture.pre_rope=true, "
                         "or set compressor.undo_rope=false")

    def _analyse(self, x: torch.Tensor) -> _Fitted:
        """Mean, basis, scales, steps and the error of every component at every width, from ``x`` ``(U, d, N)``."""
        U, d, N = x.shape
        mean = x.mean(dim=2).to(torch.float16)  # (U, d): the stored precision is the one the encoder uses
        xc = x - mean.double()[:, :, None]  # (U, d, N)
        if self.pca_scope == "layer":
            axes = [principal_axes(xc[u].T, self.rank)[1] for u in range(U)]
        else:  # one basis: layers (global) are extra samples, or there is one unit (concat)
            axes = [principal_axes(xc.permute(0, 2, 1).reshape(U * N, d), self.rank)[1]]
        r = min(a.shape[1] for a in axes)
        basis = torch.stack([a[:, :r] for a in axes]).to(torch.float16)  # (G, d, r)
        coef = (basis.transpose(1, 2).float() @ xc.float()).numpy()  # (U, r, N) float32
        sigma = np.sqrt(np.mean(np.square(coef, dtype=np.float64), axis=2))  # (U, r)
        sigma = sigma.astype(np.float16).astype(np.float64)  # as stored
        live = sigma > 0
        z = (coef[live] / sigma[live][:, None]).reshape(-1)
        rng = np.random.default_rng(0)
        sample = z if z.size <= _STEP_SAMPLES else rng.choice(z, _STEP_SAMPLES, replace=False)
        steps = calibrated_steps(sample).astype(np.float32).astype(np.float64)  # stored as float32

        # squared error of every component at every width, measured on the calibration coefficients
        dist = np.empty((U, r, MAX_WIDTH + 1))
        dist[:, :, 0] = np.mean(np.square(coef, dtype=np.float64), axis=2)
        safe = np.where(live, sigma, 1.0).astype(np.float32)[:, :, None]  # (U, r, 1)
        err = np.empty_like(coef)
        for w in range(1, MAX_WIDTH + 1):
            step = safe * np.float32(steps[w - 1])
            half = _half_range(steps[w - 1])
            np.divide(coef, step, out=err)
            np.rint(err, out=err)
            np.clip(err, -half, half, out=err)
            err *= step
            err -= coef
            np.square(err, out=err)
            dist[:, :, w] = np.where(live, err.mean(axis=2, dtype=np.float64), 0.0)
        del err
        energy = float(np.mean(np.square(x.numpy()), dtype=np.float64) * d)  # mean squared norm per unit and token
        return _Fitted(mean, basis, coef, sigma, steps, dist, energy)

    def _allocate(self, fitted: dict[str, _Fitted], n_elements: int) -> dict[str, np.ndarray]:
        """Widths ``(U, r)`` per kind under one budget of ``bits`` per element over K and V together."""
        budget = math.floor(self.bits * len(fitted) * n_elements + 1e-9)
        if self.allocation == "uniform":
            var = np.concatenate([f.dist[:, :, 0].reshape(-1) for f in fitted.values()])
            flat = allocate_uniform(var, budget)
        else:
            # the error each kind contributes relative to its energy (the keys' weighted by key_weight): raw
            # squared error would hand the bits to whichever kind has the larger values
            weight = {"k": self.key_weight, "v": 1.0}
            flat = allocate_dp(np.concatenate([f.dist.reshape(-1, MAX_WIDTH + 1) * (weight[kind] / f.energy)
                                               for kind, f in fitted.items()]), budget)
        out, at = {}, 0
        for kind, f in fitted.items():
            n = f.sigma.size
            out[kind] = np.where(f.sigma > 0, flat[at : at + n].reshape(f.sigma.shape), 0)
            at += n
        return out

    @staticmethod
    def _sections(kind: str, f: _Fitted, widths: np.ndarray) -> dict[str, Section]:
        """One kind's state sections: what its decoder needs, for the allocated widths."""
        U, d = f.mean.shape
        # histograms of the calibration symbols, one per width
        freqs = {}
        for w in range(1, MAX_WIDTH + 1):
            sel = widths == w
            if not sel.any():
                continue
            half = _half_range(f.steps[w - 1])
            q = np.clip(np.rint(f.coef[sel] / (f.sigma[sel][:, None] * f.steps[w - 1])), -half, half).astype(np.int64)
            counts = np.bincount((q + half).reshape(-1), minlength=2 * half + 1)
            spare = (1 << FREQ_BITS) - (2 * half + 1)  # every symbol keeps frequency >= 1: codable if unseen
            freqs[w] = np.floor(counts / counts.sum() * spare).astype(np.int64) + 1

        # keep each basis up to its last used component
        G = f.basis.shape[0]
        kept = widths > 0  # (U, r)
        used = kept.any(axis=0, keepdims=True) if G == 1 else kept  # (G, r)
        ranks = [int(np.flatnonzero(row)[-1]) + 1 if row.any() else 0 for row in used]
        R = max(ranks)
        basis_raw = b"".join(tensor_to_bytes(f.basis[g, :, : ranks[g]].contiguous()) for g in range(G))
        widths, sigma = widths[:, :R], f.sigma[:, :R]
        flat_freqs = np.concatenate([freqs[w] for w in sorted(freqs)]) if freqs else np.zeros(0, np.int64)
        return {
            f"{kind}.dims": varints([U, G, d, R, *ranks]),
            f"{kind}.mean": tensor_to_bytes(f.mean),
            f"{kind}.basis": basis_raw,
            f"{kind}.widths": pack_codes(torch.from_numpy(widths.astype(np.uint8)), 4),
            f"{kind}.sigma": tensor_to_bytes(torch.from_numpy(sigma[widths > 0]).to(torch.float16)),
            f"{kind}.steps": tensor_to_bytes(torch.from_numpy(f.steps).float()),
            f"{kind}.freqs": pack_codes(torch.from_numpy(flat_freqs), FREQ_BITS),
        }

    # ---- state --------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Section]:
        return dict(self._state)

    def load_state(self, sections: Mapping[str, Section]) -> None:
        if not sections:
            return
        raw = {k: bytes(v) if isinstance(v, (bytes, bytearray)) else bytes(v[0]) for k, v in sections.items()}
        codecs = {kind: self._parse_kind(kind, raw) for kind in KINDS}
        state: dict[str, Section] = dict(raw)
        for kind, c in codecs.items():  # the packed sections' exact sizes, as the encoder declared them
            state[f"{kind}.widths"] = (raw[f"{kind}.widths"], 4 * c.widths.size)
            state[f"{kind}.freqs"] = (raw[f"{kind}.freqs"], FREQ_BITS * sum(f.size for f in c.freqs.values()))
        self._codecs, self._state = codecs, state

    def _parse_kind(self, kind: str, raw: Mapping[str, bytes]) -> _KindCodec:
        def sec(name: str) -> bytes:
            key = f"{kind}.{name}"
            if key not in raw:
                raise BitstreamError(f"kvtc state has no section {key!r} (written by another version?)")
            return bytes(raw[key])

        try:
            (U, G, d, R), pos = read_varints(sec("dims"), 4)
            ranks, _ = read_varints(sec("dims"), G, pos)
            expect_g = {"layer": U, "global": 1, "concat": 1}[self.pca_scope]
            if G != expect_g or max(ranks, default=0) != R:
                raise BitstreamError(f"kvtc state for {kind} has {G} bases; pca_scope={self.pca_scope} with {U} units "
                                     f"needs {expect_g}")
            mean = tensor_from_bytes(sec("mean"), torch.float16, (U, d)).float()
            basis = torch.zeros(G, d, R)
            blob, at = sec("basis"), 0
            for g, r in enumerate(ranks):
                n = 2 * d * r
                basis[g, :, :r] = tensor_from_bytes(blob[at : at + n], torch.float16, (d, r)).float()
                at += n
            if at != len(blob):
                raise BitstreamError(f"kvtc state: {kind}.basis has {len(blob)} bytes, expected {at}")
            widths = unpack_codes(sec("widths"), 4, U * R).numpy().astype(np.int64).reshape(U, R)
            if widths.max(initial=0) > MAX_WIDTH:
                raise BitstreamError(f"kvtc state: a {kind} width exceeds {MAX_WIDTH}")
            n_kept = int((widths > 0).sum())
            sigma = np.zeros((U, R))
            sigma[widths > 0] = tensor_from_bytes(sec("sigma"), torch.float16, (n_kept,)).double().numpy()
            steps = tensor_from_bytes(sec("steps"), torch.float32, (MAX_WIDTH,)).double().numpy()
            used = sorted({int(w) for w in np.unique(widths) if w > 0})
            sizes = [2 * _half_range(steps[w - 1]) + 1 for w in used]
            flat = unpack_codes(sec("freqs"), FREQ_BITS, sum(sizes)).numpy().astype(np.int64)
        except ValueError as e:  # wrong byte counts: the state does not belong to this config or is corrupted
            if isinstance(e, BitstreamError):
                raise
            raise BitstreamError(f"kvtc state for {kind} is malformed: {e}") from e
        if (flat == 0).any():
            raise BitstreamError(f"kvtc state: a {kind} histogram has a zero frequency")
        freqs = dict(zip(used, np.split(flat, np.cumsum(sizes)[:-1]) if used else []))
        return _KindCodec(mean, basis, widths, sigma, steps, freqs)

    # ---- coding -------------------------------------------------------------------------------------------------

    def _rotary_for(self, config: Any) -> Rotary:
        if self._rotary is None or self._rotary[0] is not config:
            self._rotary = (config, Rotary(config))
        return self._rotary[1]

    def _check(self, ctx: Context) -> None:
        if not self._codecs:
            raise ValueError("kvtc has no fitted state: call fit(calib) on the encoder, or load_state() its state bytes "
                             "(kvbench.core.codec.decoder_for) on a decoder")
        L, H, _, D = ctx.shape
        c = self._codecs["k"]
        U, d = c.mean.shape
        if U * d != L * H * D or (self.pca_scope != "concat" and U != L):
            raise ValueError(f"kvtc was fitted on KV of {U * d} elements per token in {U} units; this cache is "
                             f"(layers, heads, head_dim) = ({L}, {H}, {D})")
        if self.undo_rope and ctx.config is None:
            raise ValueError("kvtc undoes RoPE on keys and needs the model config in the context (ctx.config); "
                             "the harness fills it for compressors with needs_config, or set compressor.undo_rope=false")

    def _split(self, ctx: Context) -> tuple[int, int]:
        """Exact tokens at the start (sinks: absolute positions < ``sinks``) and at the end (the recent window)."""
        T = ctx.n_tokens
        n_sink = min(T, max(0, self.sinks - ctx.start))
        return n_sink, min(self.window, T - n_sink)

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        self._check(ctx)
        T = kv.n_tokens
        n_sink, n_win = self._split(ctx)
        sections: dict[str, Section] = {}
        for kind, x in (("k", kv.k), ("v", kv.v)):
            sections[f"{kind}.exact"] = tensor_to_bytes(x[:, :, :n_sink]) + tensor_to_bytes(x[:, :, T - n_win :])
            mid = x[:, :, n_sink : T - n_win]  # (L, H, Tm, D)
            if mid.shape[2]:
                sections[f"{kind}.codes"] = self._encode_kind(kind, mid, ctx, ctx.start + n_sink)
        return Bitstream.pack(self.name, sections)

    def _encode_kind(self, kind: str, x: torch.Tensor, ctx: Context, start: int) -> tuple[bytes, int]:
        c = self._codecs[kind]
        xf = self._rotary_for(ctx.config).undo(x, start) if kind == "k" and self.undo_rope else x.float()
        cols = _columns(xf, self.pca_scope) - c.mean[:, :, None]  # (U, d, Tm)
        coef = c.basis.transpose(1, 2) @ cols  # (U, R, Tm)
        rows = coef.reshape(-1, coef.shape[2]).numpy()[c.order]  # (n_kept, Tm) float32, grouped by width
        rows *= c.row_inv_step[:, None]
        rows += c.row_half[:, None]  # symbols are offset by the half range, so that they are >= 0
        np.rint(rows, out=rows)
        np.clip(rows, 0, 2 * c.row_half[:, None], out=rows)  # coefficients past Z_CLIP deviations are clipped
        symbols = rows.astype(np.int32)  # (n_kept, Tm)
        enc = StreamEncoder()
        for width, lo, hi in c.groups:
            enc.categorical(symbols[lo:hi], c.probs[width])
        return enc.finish()

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        sec = bs.sections(expect=self.name)
        self._check(ctx)
        L, H, T, D = ctx.shape
        n_sink, n_win = self._split(ctx)
        n_mid = T - n_sink - n_win
        out = []
        for kind in KINDS:
            if f"{kind}.exact" not in sec:
                raise BitstreamError(f"kvtc bitstream has no section '{kind}.exact'")
            raw = sec[f"{kind}.exact"]
            head = L * H * n_sink * D * 2
            if len(raw) != head + L * H * n_win * D * 2:
                raise BitstreamError(f"kvtc bitstream: {kind}.exact has {len(raw)} bytes for {n_sink} + {n_win} tokens")
            x = torch.empty(L, H, T, D, dtype=ctx.dtype)  # (L, H, T, D)
            x[:, :, :n_sink] = tensor_from_bytes(raw[:head], ctx.dtype, (L, H, n_sink, D))
            x[:, :, T - n_win :] = tensor_from_bytes(raw[head:], ctx.dtype, (L, H, n_win, D))
            if n_mid:
                if f"{kind}.codes" not in sec:
                    raise BitstreamError(f"kvtc bitstream has no section '{kind}.codes'")
                x[:, :, n_sink : T - n_win] = self._decode_kind(kind, sec[f"{kind}.codes"], ctx, n_mid, ctx.start + n_sink)
            out.append(x)
        return KVSequence(out[0], out[1])

    def _decode_kind(self, kind: str, raw: bytes, ctx: Context, n: int, start: int) -> torch.Tensor:
        """The middle tokens of one kind, ``(L, H, n, D)`` float32."""
        c = self._codecs[kind]
        L, H, _, D = ctx.shape
        U, R = c.widths.shape
        dec = StreamDecoder(raw)
        kept = np.empty((c.order.size, n), dtype=np.float32)  # (n_kept, n)
        for width, lo, hi in c.groups:
            kept[lo:hi] = dec.categorical((hi - lo) * n, c.probs[width]).reshape(hi - lo, n)
        # the centre of each bin: calibration centroids would lower the squared error, but they shrink every
        # coefficient towards the mean, a bias that attention's averaging over tokens does not cancel (measured
        # on SmolLM2 it raised delta NLL at 1 and 2 bits)
        kept -= c.row_half[:, None]
        kept *= c.row_step[:, None]
        coef = np.zeros((U * R, n), dtype=np.float32)
        coef[c.order] = kept
        cols = torch.baddbmm(c.mean[:, :, None].expand(-1, -1, n), c.basis.expand(U, -1, -1),
                             torch.from_numpy(coef).view(U, R, n))  # (U, d, n)
        x = _uncolumns(cols, (L, H, n, D))  # (L, H, n, D) float32
        if kind == "k" and self.undo_rope:
            x = self._rotary_for(ctx.config).apply(x, start)
        return x
