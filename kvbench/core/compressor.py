"""The compressor interface.

A compressor turns one sequence's KV into a :class:`~kvbench.coding.bitstream.Bitstream` and back. Its decoder gets the
bitstream, the :class:`~kvbench.core.kv.Context` (shapes, dtype, model) and the codec's fitted state *as bytes*, nothing
else: the harness serialises the encoder's state with :meth:`Compressor.state`, counts those bytes itself and
decodes on a fresh instance rebuilt from the config (:func:`rebuild`) that has loaded them (:meth:`load_state`).
Hyperparameters are dataclass fields, validated in ``__post_init__``; composition is by wrapping one compressor in
another. A compressor that codes a set of sessions together (cross-session dedup) subclasses :class:`SetCompressor`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvbench.coding.bitstream import Bitstream
from kvbench.core.kv import Context, KVSequence
from kvbench.core.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from kvbench.core.next_token import NextTokenModel
    from kvbench.core.resident import Resident

#: a state or bitstream section: ``bytes`` (every bit counts) or ``(bytes, exact_bits)``
Section = bytes | tuple[bytes, int]


@dataclasses.dataclass(frozen=True)
class Kept:
    """Tokens kept by position whatever their content: the first ``sinks`` and the last ``recent`` of a sequence;
    ``recent_word`` is how tables name the last ones (``recent``: the newest tokens; ``last``: an observation
    window)."""

    sinks: int = 0
    recent: int = 0
    recent_word: str = "recent"

    def text(self) -> str:
        """``4 sinks + 128 recent``, or ``none``."""
        parts = [f"{self.sinks} sinks"] * (self.sinks > 0) + [f"{self.recent} {self.recent_word}"] * (self.recent > 0)
        return " + ".join(parts) or "none"


class Compressor(abc.ABC):
    """Base class. Subclasses are ``@dataclass``es whose fields are their hyperparameters."""

    #: registered name; also written into every bitstream header
    name: ClassVar[str] = ""
    #: True when decode(encode(kv)) is bit-exact by construction (the harness verifies it on every run)
    lossless: ClassVar[bool] = False
    #: True when the stream carries a check of what its decoder rebuilds (a checksum of the decoded ids, or of the
    #: prediction both sides must compute to the bit), so a changed payload that alters the decode is refused. A
    #: format without one has no redundancy to tell a changed code, scale or seed from another valid stream: the fuzz
    #: tests (tests/test_fuzz_streams.py) let only such a format decode a mutated payload to another cache
    content_check: ClassVar[bool] = False
    #: True when the decoder needs ``ctx.model`` (the harness then loads the model)
    needs_model: ClassVar[bool] = False
    #: True when encoder and decoder need ``ctx.config``, the model's config (e.g. to undo RoPE)
    needs_config: ClassVar[bool] = False
    #: the family tables group it under: quantizer | transform | predictive | exact | dedup | eviction
    family: ClassVar[str] = ""
    #: the relative MSE of K and of V (squared error over energy, on the entries the decoder keeps) that this class's
    #: default configuration stays under on the tiny test model's cache, declared with headroom over what it measures
    #: there; 0 where that configuration is exact. The contract suite asserts it, so a decoder that returns zeros
    #: (relative MSE 1) fails. None: not declared, which the structure tests refuse for a registered compressor
    max_rel_mse: ClassVar[float | None] = None
    #: fields added after runs of the class were published, each with the value those runs had without naming it: a
    #: run's cell key leaves the field out at that value (:meth:`keyed`), so the field does not orphan the evidence
    added_later: ClassVar[Mapping[str, Any]] = {}
    #: True for the cache format the quality axes compare every coder with (the FP8 cache serving stacks accept): the
    #: frontier's recall axis reports each cell's loss minus this one's on the same windows
    quality_reference: ClassVar[bool] = False
    #: the fields whose defaults the development split chooses (study dev_split: configs/experiment/dev_*.yaml, never
    #: the scored windows); the others are the budget or the values of the reference the class cites. A class that
    #: fits codec state (overrides :meth:`state`) declares them, and tests/test_dev_defaults.py asserts that each
    #: default in ``configs/compressor/<name>.yaml`` is the setting the committed dev evidence chose
    tuned: ClassVar[tuple[str, ...]] = ()

    def fit(self, calib: Sequence[KVSequence], config: Any = None) -> None:
        """Learn codebooks or predictors on calibration sequences (disjoint from the evaluated ones). ``config`` is
        the model's config (free, as in :class:`~kvbench.core.kv.Context`), given to compressors that declare
        ``needs_config`` (e.g. to undo RoPE on the calibration keys)."""

    @abc.abstractmethod
    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream: ...

    @abc.abstractmethod
    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence: ...

    def resident(self, bs: Bitstream, ctx: Context) -> Resident | None:
        """What a resident cache holds of one stored segment, parsed from ``bs`` once, when this compressor can
        decode one layer alone from it (:class:`~kvbench.core.resident.Layered`: held tensors, counted as the cache's
        bytes). None (the default): the cache keeps the bytes and decodes the whole sequence per forward pass."""
        return None

    def label(self) -> str:
        """This configuration's curve in tables and figures: the name, or the name and the variant that makes a
        curve of its own (TurboQuant's range-coded codes)."""
        return self.name

    def exact_tokens(self, n_tokens: int) -> Kept:
        """The tokens of an ``n_tokens`` sequence this compressor stores exactly in the cache dtype (attention sinks,
        a recent window); none by default."""
        return Kept()

    def always_kept(self, n_tokens: int) -> Kept | None:
        """For a compressor that drops tokens, those it keeps before scoring any; None for one that keeps every
        token."""
        return None

    def facts(self, n_tokens: int) -> dict[str, Any]:
        """What tables say of this configuration beside its fields, for ``n_tokens``-token sequences: run summaries
        file it under ``compressor_facts``, so that the report reads it instead of knowing compressors."""
        kept = self.always_kept(n_tokens)
        return {"family": self.family, "label": self.label(), "exact_tokens": self.exact_tokens(n_tokens).text(),
                "always_kept": None if kept is None else kept.text(), "quality_reference": self.quality_reference}

    def kind_weights(self) -> tuple[float, float]:
        """The weights of the keys' and the values' relative squared error in the objective this coder's allocation
        minimises (equal by default); the run's weighted Gaussian R(D) reference prices the error so
        (:mod:`kvbench.measure.metrics.rate_distortion`)."""
        return (1.0, 1.0)

    def next_token_model(self, model: Any) -> NextTokenModel | None:
        """For a coder whose encoder and decoder run ``model`` one token at a time (it codes ids under the model's
        next-token distribution): a fresh :class:`~kvbench.core.next_token.NextTokenModel` as the coder steps it,
        on the coder's threads. None for the others. ``python -m kvbench stepcost`` times it against a plain step."""
        return None

    def decode_flops_per_token(self, config: Any, n_tokens: int) -> float:
        """Model FLOPs the decoder spends per restored token of an ``n_tokens`` sequence (``config``: the model's
        config, free); 0 for a decoder that runs no model."""
        return 0.0

    def encode_flops_per_token(self, config: Any, n_tokens: int) -> float:
        """Model FLOPs the encoder spends per coded token of an ``n_tokens`` sequence (an eviction method scoring
        with the model's queries); 0 for an encoder that runs no model."""
        return 0.0

    def recent_window(self) -> int:
        """The most recent tokens this compressor keeps in the cache dtype itself while a cache decodes (KIVI's
        residual window); 0 when it keeps none. A resident cache keeps them in its own window instead, on
        :meth:`without_recent_window`."""
        return 0

    def without_recent_window(self) -> Compressor:
        """This compressor coding every token it is given: the working copy of a cache whose own window holds the
        recent tokens, so that they are not kept twice."""
        return self

    def state(self) -> dict[str, Section]:
        """What :meth:`fit` learned that the decoder needs (predictor weights, fitted steps, codebooks that are
        not derivable from the config), as named byte sections; empty when nothing was fitted.

        The harness frames these sections, counts every bit of the frame itself (``codec_bits``, charged once per
        run) and hands the bytes to a fresh instance's :meth:`load_state`: nothing else crosses from encoder to
        decoder.
        """
        return {}

    def load_state(self, sections: Mapping[str, bytes]) -> None:
        """Restore what :meth:`state` wrote, on an instance built from the same config that was never fitted."""
        if sections:
            raise ValueError(f"compressor {self.name!r} has no fitted state, but state sections {sorted(sections)} were given")

    def stats(self) -> dict[str, Any]:
        """What the compressor measured along the way, summed over the run's sequences: time per stage (a model
        pass inside decode), the model-estimated size next to the coded one. The harness files it under
        ``compressor_stats``. Never the rate itself: that is counted from the bitstreams.
        """
        return {}

    def describe(self) -> dict[str, Any]:
        """Name and hyperparameters, for summaries."""
        return self._params(keyed=False)

    def keyed(self) -> dict[str, Any]:
        """:meth:`describe` as a run's ``cell_key`` hashes it: a field in :attr:`added_later` at the value it names is
        left out, so a run measured before the field existed keys as the same cell."""
        return self._params(keyed=True)

    def _params(self, keyed: bool) -> dict[str, Any]:
        return {"name": self.name, **{k: v._params(keyed) if isinstance(v, Compressor) else v
                                      for k, v in _fields(self).items()
                                      if not (keyed and k in self.added_later and v == self.added_later[k])}}


class SetCompressor(Compressor):
    """A compressor that codes a set of sessions into one bitstream (cross-session dedup).

    The harness hands a workload's sessions to :meth:`encode_set` together; one sequence alone is a set of one.
    """

    @abc.abstractmethod
    def encode_set(self, kvs: Sequence[KVSequence], ctxs: Sequence[Context]) -> Bitstream: ...

    @abc.abstractmethod
    def decode_set(self, bs: Bitstream, ctxs: Sequence[Context]) -> list[KVSequence]: ...

    def encode(self, kv: KVSequence, ctx: Context) -> Bitstream:
        return self.encode_set([kv], [ctx])

    def decode(self, bs: Bitstream, ctx: Context) -> KVSequence:
        return self.decode_set(bs, [ctx])[0]

    def prefix_cache(self) -> PrefixCache:
        """The prefix cache (granularity, budget, policy) the sessions are replayed through for the workload's
        hit-rate statistics; a fresh, empty one."""
        return PrefixCache()


def fits(c: Compressor) -> bool:
    """True when ``c`` (or a compressor it wraps) learns anything in :meth:`Compressor.fit`."""
    if type(c).fit is not Compressor.fit:
        return True
    return any(fits(v) for v in _fields(c).values() if isinstance(v, Compressor))


def _fields(c: Compressor) -> dict[str, Any]:
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c)} if dataclasses.is_dataclass(c) else {}


def config_of(c: Compressor) -> dict[str, Any]:
    """The hyperparameters that rebuild ``c``, wrapped compressors as nested dicts (no fitted state)."""
    return {k: config_of(v) if isinstance(v, Compressor) else v for k, v in _fields(c).items()}


def rebuild(c: Compressor) -> Compressor:
    """A fresh, unfitted instance of ``c``'s class from its hyperparameters alone (wrapped compressors rebuilt
    likewise): the decoder the harness uses, so that nothing but the config and the state bytes reaches it."""
    import copy

    return type(c)(**{k: rebuild(v) if isinstance(v, Compressor) else copy.deepcopy(v) for k, v in _fields(c).items()})
