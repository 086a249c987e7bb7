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
   DP (:func:`compressors.transform.kvtc_calibration.allocate_dp`) makes the calibration error least: the squared
   error of the quantizer at each width, measured on the calibration coefficients, relative to the energy of its
   kind (K or V), the keys' weighted by ``key_weight``. Width 0 drops the component. ``allocation=uniform`` gives
   every component the same width instead, for comparison.
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
  whichever kind has the larger values. ``key_weight`` defaults to 0.125, chosen on the development split
  (``dataset.split=dev``: windows from other documents than the scored ones; study ``dev_split``, preset
  ``dev_kvtc``) among 1/16-1/2 at 1 and 2 bits without the exact window, as the weight with the lowest objective
  (relative next-token NLL change plus relative recall-probe change) summed over both budgets: at 1 bit the other
  weights lose far more on both axes; at 2 bits a larger weight keeps more recall (``results/dev_split.md``).
- ``pca_scope`` defaults to ``layer``, not the paper's ``concat``: on the development split, with the two
  calibration windows a run fits on, one basis over all layers' heads has more dimensions than calibration tokens,
  its calibrated histograms undercount the coded bits (its streams run a fifth above the budget), and at its budget
  it spends more stream bits than the per-layer basis; the dev study's matched-rate rule does not choose it.
- The entropy coder is a range coder under fitted histograms instead of DEFLATE (nvCOMP); the basis comes from an
  exact eigendecomposition, not randomized SVD; calibration uses every calibration token after the sinks (the
  windows' last tokens are ordinary text there, so they are kept as data). Coefficients beyond ``Z_CLIP``
  calibration standard deviations are clipped.

Codec state (:meth:`Kvtc.state`, charged once per run): per kind the means (float16), the kept basis columns
(float16), the widths (4 bits each), the kept components' σ (float16), the steps Δ_w (float32) and the histograms
(16-bit frequencies). The encoder codes with the state as parsed back from those bytes, so both sides use the very
same numbers. The fit gives the same bytes on any machine: covariances and coefficients are float64 sums rounded
once to the stored precision, each axis's sign is fixed (an eigensolver's is arbitrary), see
:mod:`compressors.predictive.fit_numerics` and ``tests/test_fit_determinism.py``.

Calibration keys come from ``fit(calib, config=...)`` with RoPE undone at positions from 0 (calibration windows start
a sequence), or from pre-RoPE keys captured with the windows (``capture.pre_rope=true``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from compressors.transform.kvtc_calibration import (
    ALLOCATIONS,
    FREQ_BITS,
    MAX_WIDTH,
    SCOPES,
    allocate,
    analyse,
    calibration_keys,
    columns,
    half_range,
    raw_sections,
    state_sections,
    uncolumns,
)
from kvbench.coding.bitstream import Bitstream, BitstreamError, read_varints
from kvbench.coding.entropy import StreamDecoder, StreamEncoder
from kvbench.coding.packing import tensor_from_bytes, tensor_to_bytes, unpack_codes
from kvbench.core.checks import check_choice, check_range
from kvbench.core.compressor import Compressor, Kept, Section
from kvbench.core.kv import Context, KVSequence
from kvbench.core.rope import Rotary

KINDS = ("k", "v")


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
        halves = np.array([0] + [half_range(float(s)) for s in self.steps], dtype=np.float32)
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
    key_weight: float = 0.125
    undo_rope: bool = True

    name: ClassVar[str] = "kvtc"
    family: ClassVar[str] = "transform"
    max_rel_mse: ClassVar[float] = 0.2  # 2 bits: 0.104 (K), 0.010 (V) measured
    tuned: ClassVar[tuple[str, ...]] = ("key_weight", "pca_scope")
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

    def label(self) -> str:
        return self.name if self.window else f"{self.name} (no window)"

    def kind_weights(self) -> tuple[float, float]:
        return (self.key_weight, 1.0)  # the DP's objective (kvtc_calibration.allocate)

    def exact_tokens(self, n_tokens: int) -> Kept:
        return Kept(self.sinks, self.window)

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
            cols = [columns(self._calib_kind(kv, kind, config)[:, :, min(self.sinks, kv.n_tokens):], self.pca_scope)
                    for kv in calib]  # each (U, d, T_i)
            x = torch.cat(cols, dim=2).double()  # (U, d, N)
            if x.shape[2] < 2:
                raise ValueError(f"kvtc.fit: {x.shape[2]} calibration tokens after the {self.sinks} sinks; need >= 2")
            fitted[kind] = analyse(x, self.pca_scope, self.rank)
        widths = allocate(fitted, L * H * D, self.bits, self.allocation, self.key_weight)
        sections: dict[str, Section] = {}
        for kind, f in fitted.items():
            sections.update(state_sections(kind, f, widths[kind]))
        self.load_state(sections)

    def _calib_kind(self, kv: KVSequence, kind: str, config: Any) -> torch.Tensor:
        if kind == "v":
            return kv.v.float()
        if not self.undo_rope:
            return kv.k.float()
        return calibration_keys("kvtc", kv, config, self._rotary_for, ", or set compressor.undo_rope=false")


    # ---- state --------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Section]:
        return dict(self._state)

    def load_state(self, sections: Mapping[str, Section]) -> None:
        if not sections:
            return
        raw = raw_sections(sections)
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
            sizes = [2 * half_range(steps[w - 1]) + 1 for w in used]
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
        cols = columns(xf, self.pca_scope) - c.mean[:, :, None]  # (U, d, Tm)
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
        dec.finish(f"kvtc {kind}.codes")
        # the centre of each bin: calibration centroids would lower the squared error, but they shrink every
        # coefficient towards the mean, a bias that attention's averaging over tokens does not cancel (measured
        # on SmolLM2 it raised delta NLL at 1 and 2 bits)
        kept -= c.row_half[:, None]
        kept *= c.row_step[:, None]
        coef = np.zeros((U * R, n), dtype=np.float32)
        coef[c.order] = kept
        cols = torch.baddbmm(c.mean[:, :, None].expand(-1, -1, n), c.basis.expand(U, -1, -1),
                             torch.from_numpy(coef).view(U, R, n))  # (U, d, n)
        x = uncolumns(cols, (L, H, n, D))  # (L, H, n, D) float32
        if kind == "k" and self.undo_rope:
            x = self._rotary_for(ctx.config).apply(x, start)
        return x
