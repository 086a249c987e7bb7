"""Every compressor's parser fed mutated streams (property-based, with hypothesis).

The valid stream of every ``configs/compressor/*.yaml`` (tests/stream_cases.py) is mutated two ways:

- **frame mutations**, as storage corrupts bytes: a bit flipped anywhere, the stream truncated, bytes appended.
  The frame's length and CRC-32 checks must reject every one with a :class:`BitstreamError`.
- **section mutations**, with the frame rebuilt around them and its checksum recomputed, as a buggy or hostile
  writer would produce: a bit flipped or a run of bytes overwritten inside a section, a section truncated,
  extended, dropped, added or renamed, two sections' payloads swapped, or an integer of a varint header (an index,
  a count, a flag) changed to 0, 1, its neighbours, its double or a huge value; the same inside a stream embedded
  whole in a section (speculative's token stream), with the inner frame rebuilt too.

What a decoder must do with a section mutation:

1. raise :class:`BitstreamError` or ``ValueError`` from a ``raise`` statement of kvbench or of a compressor (a
   message that says what is wrong), never another exception type nor one thrown inside numpy, torch or the coder
   library;
2. stay within a CPU-time watchdog and an address-space budget (:func:`bounded`) far above what the declared
   shapes justify (a few MB here), so a hostile count can neither hang it nor make it allocate gigabytes;
3. or return caches of exactly the declared shapes and dtype, and then what "silently differs" can honestly mean
   depends on the mutation:

   - one that changes what a section holds as a whole (*structure*: truncated, extended, dropped, added,
     renamed, a header integer whose varint grew or shrank): every length in a stream follows from the declared
     shapes and the stream's own header, or ends where its coder says (an entropy coder's last word, a deflate
     stream's end), so the decode must equal the original one (the mutation hit bytes the format never reads,
     such as an unknown section or bytes past the end of a coder's stream). A decoder that read a wrong length
     without noticing is a bug;
   - one that changes values in place (*payload*: bits flipped, bytes overwritten, a header integer changed in
     place, two sections' payloads swapped, each a valid payload of the format): a code, a scale, a seed, a
     count, which plane is which. A format without redundancy reads them as another valid stream (a lossy
     coder's decoder does not know what the encoder saw, so there is nothing to compare a changed value with;
     two self-delimiting streams of one shape, such as K's and V's residuals, cannot tell which is which), and a
     different decode of the right shape is what such a format means; where the change still makes a length
     inconsistent the decoder must say so (rule 1). A format that carries a content check (its class says
     ``content_check``: a checksum of what the decoder rebuilds) must reject any payload change that alters its
     decode.

   Two exceptions are known and tallied as such (:func:`known_limit`): a range-coded stream followed by raw bytes
   in one section (delta's residuals), extended by exactly one 32-bit word; and a range-coded section cut to a
   whole number of 32-bit words where the coder's end check passes (a range-coded stream carries no length).

What is counted: only a section mutation reaches a decoder (a frame mutation is refused by the frame's checksum
before any decoder runs; those are tallied apart). Each test of a compressor decodes a fixed number of *distinct*
mutated streams whose every frame (its own, an embedded stream's, that of a stream stored as sections around a
``P/frame``) parses and checks, skips a stream it already decoded, and fails when fewer than that number reached
the decoder, or when a frame's checksum refused one it counted. How many (:func:`targets`):

- the dedicated fuzz run, ``pytest -m fuzz``: :data:`DEDICATED` for every compressor (:data:`DEDICATED` / 2 frame
  mutations), the count scripts/reliability.py publishes in results/reliability.md;
- any other run (``make test``): :data:`DEFAULT`, fewer for the decoders in :data:`SLOW`, so the whole suite keeps
  its time;
- ``KVBENCH_FUZZ_EXAMPLES=N`` overrides both: ``N`` for every compressor.

The search is derandomised, so a run is reproducible. ``KVBENCH_FUZZ_TALLY`` names a file that gets one JSON line
per mutated stream (what was tried and what the decoder did) and one per test and compressor (``test: "case"``: the
config, its overrides, the counts asked for and the class's ``content_check``); scripts/reliability.py files them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import linecache
import os
import resource
import signal
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stream_cases import ALL, VARIANTS, Case, build

from compressors.exact.identity import Identity
from kvbench.coding.bitstream import Bitstream, BitstreamError, read_varints, varints
from kvbench.coding.packing import tensor_from_bytes
from kvbench.core.kv import KVSequence

pytestmark = pytest.mark.fuzz

#: every configured compressor, and variants whose streams have parsers of their own (tests/stream_cases.py)
CASES = ALL + list(VARIANTS)

ROOT = Path(__file__).resolve().parents[1]
#: distinct mutated streams that reach each compressor's decoder in the dedicated run (``pytest -m fuzz``)
DEDICATED = 200
#: and in any other run; fewer for decoders that run the model one token at a time
DEFAULT = 24
SLOW = {"recompute": 4, "speculative": 4}
#: the tally's outcome of a section mutation whose stream a frame would refuse (not decoded, not counted)
FRAME_REFUSED = "refused by a frame"
#: how a frame's checksum refuses a stream (kvbench.coding.bitstream): never the fate of a counted mutation
CHECKSUM = "bitstream checksum mismatch"
#: address space a decode may add, far above what the cases' shapes justify (their caches are under 1 MB)
MEMORY = 768 << 20
#: CPU seconds a decode may take before it counts as a hang (a valid one takes well under a second)
CPU_SECONDS = 60

STRUCTURE = ("truncate", "extend", "drop", "add", "rename", "varint")
PAYLOAD = ("flip", "overwrite", "swap")


def targets(config: pytest.Config, name: str) -> tuple[int, int]:
    """(section mutations that must reach the decoder, frame mutations) for compressor ``name`` in this run: see
    the module docstring."""
    if os.environ.get("KVBENCH_FUZZ_EXAMPLES"):
        n = int(os.environ["KVBENCH_FUZZ_EXAMPLES"])
        if n < 2:
            raise ValueError(f"KVBENCH_FUZZ_EXAMPLES={n}: at least 2 mutated streams per compressor")
    elif (config.option.markexpr or "").strip() == "fuzz":
        n = DEDICATED
    else:
        return SLOW.get(name, DEFAULT), DEFAULT // 2
    return n, max(2, n // 2)


class Hang(Exception):
    """A decode ran past the CPU-time watchdog."""


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextmanager
def bounded(memory: int = MEMORY, cpu_seconds: float = CPU_SECONDS):
    """Run the block with at most ``memory`` more bytes of address space (an allocation past it fails with
    MemoryError or torch's RuntimeError, which the oracle counts as a failure) and ``cpu_seconds`` of CPU time
    (then :class:`Hang` is raised in it). CPU time, not wall time: a loaded machine does not trip it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + memory
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)

    def hang(signum, frame):
        raise Hang(f"decode used more than {cpu_seconds} s of CPU time")

    previous = signal.signal(signal.SIGVTALRM, hang)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_VIRTUAL, cpu_seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGVTALRM, previous)


@functools.cache
def _raise_lines(path: str) -> frozenset[int]:
    """The lines of ``path`` that belong to a ``raise`` statement."""
    tree = ast.parse(Path(path).read_text())
    return frozenset(n for node in ast.walk(tree) if isinstance(node, ast.Raise)
                     for n in range(node.lineno, node.end_lineno + 1))


def _raised_by_a_raise_statement(exc: BaseException) -> tuple[bool, str]:
    """Whether ``exc`` was raised by a ``raise`` of kvbench or compressors code (not inside a library, not by
    a library call on that line), and where."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False, "?"
    path = Path(tb.tb_frame.f_code.co_filename)
    where = f"{path}:{tb.tb_lineno}: {linecache.getline(str(path), tb.tb_lineno).strip()}"
    ours = path.is_relative_to(ROOT / "kvbench") or path.is_relative_to(ROOT / "compressors")
    return ours and tb.tb_lineno in _raise_lines(str(path)), where


# ---------------------------------------------------------------------------------------------- mutations


@dataclass
class Mutation:
    op: str  # one of PAYLOAD or STRUCTURE, "nested:" + op inside an embedded stream
    section: str
    data: bytes = field(repr=False)
    #: "payload" (every length kept) or "structure"
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or ("payload" if self.op.removeprefix("nested:") in PAYLOAD else "structure")


def _parse(data: bytes) -> tuple[str, dict[str, tuple[bytes, int]]]:
    stored = Bitstream.from_bytes(data)
    return stored.compressor, {n: (raw, stored.parts[n]) for n, raw in stored.sections().items()}


def _embedded(raw: bytes) -> bool:
    try:
        return raw[:3] == b"KVB" and bool(_parse(raw)[1])
    except BitstreamError:
        return False


def _split_streams(secs: dict[str, tuple[bytes, int]]) -> dict[str, list[str]]:
    """Streams stored as sections of their own (a wrapper's inner stream, a pipeline's segments): per prefix ``P/``
    whose ``P/frame`` section holds a frame's header and checksum, the section names the decoder joins into it
    (``P/frame`` and, in stream order, every other ``P/`` section)."""
    return {name[:-len("frame")]: [n for n in secs if n.startswith(name[:-len("frame")])]
            for name, (raw, _) in secs.items() if name.endswith("/frame") and raw[:3] == b"KVB"}


def _joined(secs: dict[str, tuple[bytes, int]], prefix: str) -> bytes:
    """The stream whose frame and sections are stored under ``prefix``, joined as its decoder joins them."""
    frame = secs[f"{prefix}frame"][0]
    body = b"".join(raw for n, (raw, _) in secs.items() if n.startswith(prefix) and n != f"{prefix}frame")
    return frame[:-4] + body + frame[-4:]


def _resplit(secs: dict[str, tuple[bytes, int]], prefix: str, data: bytes) -> dict[str, tuple[bytes, int]]:
    """``secs`` with the stream under ``prefix`` replaced by ``data``, stored as its encoder stores it, where it
    stood."""
    stored = Bitstream.from_bytes(data)
    payloads = stored.sections()
    body = sum(len(raw) for raw in payloads.values())
    frame = data[: len(data) - 4 - body] + data[-4:]  # its header and checksum
    group = {f"{prefix}frame": (frame, _bits(frame)), **{f"{prefix}{n}": (raw, stored.parts[n]) for n, raw in payloads.items()}}
    out: dict[str, tuple[bytes, int]] = {}
    for n, v in secs.items():
        if not n.startswith(prefix):
            out[n] = v
        elif not any(k.startswith(prefix) for k in out):
            out.update(group)
    return out


def _header_values(raw: bytes) -> list[int] | None:
    """The section read as varints end to end, if it is a short one that reads so (a header or an index)."""
    if not 0 < len(raw) <= 64:
        return None
    out, pos = [], 0
    try:
        while pos < len(raw):
            (v,), pos = read_varints(raw, 1, pos)
            out.append(v)
    except BitstreamError:
        return None
    return out


def _bits(raw: bytes) -> int:
    return 8 * len(raw)


@st.composite
def section_mutation(draw, data: bytes, depth: int = 0) -> Mutation:
    """A mutated copy of the stream ``data`` with its frame rebuilt (checksum recomputed). A stream embedded whole
    in a section, or stored as sections of its own around a ``P/frame``, is changed only inside it, its own frame
    rebuilt too (``nested``): a byte changed in place would meet that frame's checksum, not the decoder."""
    name, secs = _parse(data)
    names = list(secs)
    embedded = [n for n in names if _embedded(secs[n][0])]
    split = _split_streams(secs)
    members = {n for group in split.values() for n in group}
    free = [n for n in names if n not in members]  # sections a whole-section mutation may move, drop or name
    nonempty = [n for n in free if secs[n][0] and n not in embedded]
    headers = {n: v for n in free if n not in embedded and (v := _header_values(secs[n][0])) is not None}
    nested = [*embedded, *split] if depth == 0 else []
    ops = [*(("flip", "overwrite", "truncate") if nonempty else ()), "extend", "add"]
    ops += [*(("drop", "rename") if free else ()), *(("swap",) if len(free) > 1 else ())]
    ops += [*(("varint",) if headers else ()), *(("nested",) if nested else ())]
    op = draw(st.sampled_from(ops))
    out = dict(secs)
    if op == "nested":
        target = draw(st.sampled_from(nested))
        if target in split:
            inner = draw(section_mutation(_joined(secs, target), depth + 1))
            out = _resplit(secs, target, inner.data)
        else:
            inner = draw(section_mutation(secs[target][0], depth + 1))
            out[target] = (inner.data, _bits(inner.data))
        where = f"{target}{inner.section}" if target in split else f"{target}/{inner.section}"
        return Mutation(f"nested:{inner.op}", where, Bitstream.pack(name, out).data, inner.kind)
    extendable = [n for n in free if n not in embedded] or [""]
    target = draw(st.sampled_from({"flip": nonempty, "overwrite": nonempty, "truncate": nonempty,
                                   "extend": extendable, "varint": sorted(headers)}.get(op, free or [""])))
    raw, nbits = secs.get(target, (b"", 0))
    if op == "flip":
        bit = draw(st.integers(0, 8 * len(raw) - 1))
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        out[target] = (bytes(flipped), nbits)
    elif op == "overwrite":
        at = draw(st.integers(0, len(raw) - 1))
        junk = draw(st.binary(min_size=1, max_size=min(16, len(raw) - at)))
        out[target] = (raw[:at] + junk + raw[at + len(junk):], nbits)
    elif op == "truncate":
        keep = draw(st.integers(0, len(raw) - 1))
        out[target] = (raw[:keep], _bits(raw[:keep]))
    elif op == "extend":
        more = raw + draw(st.binary(min_size=1, max_size=16))
        out[target or "extra"] = (more, _bits(more))
        return Mutation(op, f"{target or 'extra'} (+{len(more) - len(raw)} bytes)", Bitstream.pack(name, out).data)
    elif op == "drop":
        del out[target]
    elif op == "add":
        new = draw(st.sampled_from([f"{target}~", f"{target}/x", "extra", "k", "header", "0/frame"]))
        if new in out:
            new = f"{new}~"
        payload = draw(st.binary(min_size=0, max_size=32))
        out[new] = (payload, _bits(payload))
        target = new
    elif op == "rename":
        other = draw(st.sampled_from([n for n in free if n != target] + [f"{target}~"]))
        out = {(f"{other}~" if n == other else other if n == target else n): v for n, v in secs.items()}
    elif op == "swap":
        other = draw(st.sampled_from([n for n in free if n != target]))
        out[target], out[other] = secs[other], secs[target]
        return Mutation(op, f"{target}<->{other}", Bitstream.pack(name, out).data)
    else:  # varint
        values = headers[target]
        i = draw(st.integers(0, len(values) - 1))
        v = values[i]
        new = draw(st.sampled_from(sorted({0, 1, max(v - 1, 0), v + 1, 2 * v + 1, 1 << 20, 1 << 40, (1 << 62) + 1} - {v})))
        edited = varints([*values[:i], new, *values[i + 1:]])
        out[target] = (edited, _bits(edited))
        kind = "payload" if len(edited) == len(raw) else "structure"
        return Mutation(op, f"{target}[{i}]: {v} -> {new}", Bitstream.pack(name, out).data, kind)
    return Mutation(op, target, Bitstream.pack(name, out).data)


# ---------------------------------------------------------------------------------------------- the oracle


def _tally(**row) -> None:
    path = os.environ.get("KVBENCH_FUZZ_TALLY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _tally_case(case: Case, test: str, reach: int, frame: int) -> None:
    """The tally's line for one test of one compressor: what the stream is and how many mutations are asked for."""
    config, overrides = VARIANTS.get(case.name, (case.name, ()))
    _tally(compressor=case.name, test="case", of=test, config=config, overrides=list(overrides), reach=reach,
           frame=frame, content_check=bool(type(case.decoder).content_check), stream_bytes=len(case.stream.data))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x.k, y.k) and torch.equal(x.v, y.v) and (
        (x.kept is None and y.kept is None) or (x.kept is not None and y.kept is not None and torch.equal(x.kept, y.kept)))
        for x, y in zip(a, b))


def _section_bytes(data: bytes, name: str) -> int | None:
    """The length of top-level section ``name`` of stream ``data``; None when it has none of that name."""
    try:
        got = Bitstream.from_bytes(data).sections().get(name)
    except (BitstreamError, ValueError):
        return None
    return None if got is None else len(got)


def known_limit(case, m: Mutation) -> str | None:
    """The decodes after a structure mutation that the formats cannot tell from the original, and why; None for
    any other. A range-coded stream carries no length of its own, and the coder's end check (constriction's
    ``maybe_exhausted``) cannot tell every stream from a cut or a longer one:

    - it accepts one 32-bit word past the end of a stream (its last word may be a partial one the decoder
      completes); delta's residual section holds its range-coded byte planes followed by its raw ones, found from
      the section's end, so a section extended by exactly one word reads them shifted by it;
    - a range-coded section cut to a whole number of words decodes the missing words as the coder's implicit
      ones, and for some cut points the end check passes (a decoder refuses a cut that leaves a partial word).

    Telling either would take the coded length in the stream (more bits) or a re-encode of what was decoded (the
    decoder's time); the page counts them per compressor."""
    residual = case.name.split("/")[0] == "delta" and m.section.split(" ")[0].endswith(".residual")
    if residual and m.op == "extend" and m.section.endswith("(+4 bytes)"):
        return "one word past a range-coded stream shifts the raw planes after it"
    if m.op == "truncate":
        cut, whole = _section_bytes(m.data, m.section), _section_bytes(case.stream.data, m.section)
        if cut is not None and whole is not None and cut < whole and cut % 4 == 0 and whole % 4 == 0:
            return "a range-coded section cut at a 32-bit word boundary passes the coder's end check"
    return None


def judge(case, m: Mutation, test: str) -> str:
    """Decode ``m`` on the case's decoder and hold the result to the rules of the module docstring; returns the
    outcome (and tallies it), fails the test otherwise."""
    checked = type(case.decoder).content_check
    row = {"compressor": case.name, "test": test, "op": m.op, "kind": m.kind, "section": m.section,
           "stream": _digest(m.data)}
    try:
        with bounded():
            got = case.decode(m.data)
    except (BitstreamError, ValueError) as e:
        ours, where = _raised_by_a_raise_statement(e)
        if not ours or not str(e):
            _tally(**row, outcome="failure", detail=f"{type(e).__name__} not raised by kvbench: {where}: {e}")
            pytest.fail(f"{case.name}, {m.op} of {m.section}: {type(e).__name__} ({e}) comes from {where}, not from "
                        "a check of kvbench or the compressor that names what is wrong")
        if str(e).startswith(CHECKSUM):  # the mutation was counted as reaching the decoder; a frame met it
            _tally(**row, outcome="failure", detail=f"a frame's checksum refused it: {where}")
            pytest.fail(f"{case.name}, {m.op} of {m.section}: a frame's checksum refused it ({where}), not the decoder")
        outcome = "rejected: BitstreamError" if isinstance(e, BitstreamError) else "rejected: ValueError"
        _tally(**row, outcome=outcome, detail=str(e)[:200])
        return outcome
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any other type is the finding (a Rust panic is a BaseException)
        _, where = _raised_by_a_raise_statement(e)
        _tally(**row, outcome="failure", detail=f"{type(e).__name__}: {e} at {where}"[:300])
        pytest.fail(f"{case.name}, {m.op} of {m.section}: {type(e).__name__}: {e}\n  raised at {where}")
    shapes = [(tuple(o.shape), o.k.dtype, o.v.dtype) for o in got]
    declared = [(c.shape, c.dtype, c.dtype) for c in case.ctxs]
    if shapes != declared:
        _tally(**row, outcome="failure", detail=f"decoded {shapes}, declared {declared}")
        pytest.fail(f"{case.name}, {m.op} of {m.section}: decoded shapes {shapes}, declared {declared}")
    if _same(got, case.decoded):
        _tally(**row, outcome="no-op: decodes as the original")
        return "no-op"
    if (limit := known_limit(case, m)) is not None:
        _tally(**row, outcome="decoded: known limit", detail=limit)
        return "known limit"
    if m.kind == "structure" or checked:
        why = "a structure mutation" if m.kind == "structure" else "a format with a content check"
        _tally(**row, outcome="failure", detail=f"decoded silently to another cache after {why}")
        pytest.fail(f"{case.name}, {m.op} of {m.section}: decoded silently to another cache ({why})")
    _tally(**row, outcome="decoded: another valid stream")
    return "decoded"


def _settings(examples: float):
    return settings(max_examples=max(2, round(examples)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", CASES)
def test_frame_mutations_are_rejected_by_the_frame(name, request):
    """Storage corruption: any flipped bit, truncation or extension fails the frame's checks."""
    case = build(name)
    data = case.stream.data
    frame = targets(request.config, name)[1]
    _tally_case(case, "frame", 0, frame)

    @_settings(frame)  # cheap: the frame rejects them before any decoder runs
    @given(st.data())
    def check(draw):
        op = draw.draw(st.sampled_from(["flip", "truncate", "extend"]))
        if op == "flip":
            bit = draw.draw(st.integers(0, 8 * len(data) - 1))
            bad = bytearray(data)
            bad[bit // 8] ^= 1 << (bit % 8)
            bad = bytes(bad)
        elif op == "truncate":
            bad = data[: draw.draw(st.integers(0, len(data) - 1))]
        else:
            bad = data + draw.draw(st.binary(min_size=1, max_size=64))
        with pytest.raises(BitstreamError) as e, bounded():
            case.decode(bad)
        ours, where = _raised_by_a_raise_statement(e.value)
        assert ours and "kvbench/coding/bitstream.py" in where, where
        _tally(compressor=name, test="frame", op=op, kind="frame", section="", stream=_digest(bad),
               outcome="rejected: BitstreamError", detail=str(e.value)[:200])

    check()


@pytest.mark.parametrize("name", CASES)
def test_section_mutations_are_rejected_or_harmless(name, request):
    """A rebuilt frame around mutated sections: rejected with a clear error, or a decode the rules allow; the
    asked number of distinct mutated streams, each behind a valid frame, reaches the decoder."""
    case = build(name)
    reach = targets(request.config, name)[0]
    _tally_case(case, "sections", reach, 0)
    reached: set[bytes] = set()
    embedded = [n for n, (raw, _) in _parse(case.stream.data)[1].items() if _embedded(raw)]

    # a few more draws than streams asked for: hypothesis draws the odd stream twice, decoded only once, and the odd
    # one a frame refuses (not counted)
    @_settings(reach + reach // 4 + 4)
    @given(section_mutation(case.stream.data))
    def check(m):
        digest = hashlib.sha256(m.data).digest()
        if len(reached) >= reach or digest in reached:
            return
        if not _behind_valid_frames(m.data, embedded):  # not counted: a frame, not the decoder, would meet it
            _tally(compressor=name, test="sections", op=m.op, kind=m.kind, section=m.section, stream=_digest(m.data),
                   outcome=FRAME_REFUSED)
            return
        reached.add(digest)
        judge(case, m, "sections")

    check()
    if len(reached) < reach:
        pytest.fail(f"{name}: {len(reached)} distinct mutated streams reached the decoder of {reach} asked for")


def _behind_valid_frames(data: bytes, embedded: Iterable[str]) -> bool:
    """Whether the frame of ``data``, of the streams embedded whole in its sections ``embedded`` (where they still
    start as a stream does) and of every stream stored as sections around a ``P/frame`` parse and check: then the
    decoder, not a frame, meets the mutation."""
    try:
        secs = _parse(data)[1]
        for n in embedded:
            if secs.get(n, (b"",))[0][:3] == b"KVB":
                _parse(secs[n][0])
        for prefix in _split_streams(secs):
            _parse(_joined(secs, prefix))
        return True
    except BitstreamError:
        return False


class _Lax(Identity):
    """Identity whose decoder zero-pads a short section instead of refusing it."""

    def decode(self, bs, ctx):
        sec = bs.sections(expect=self.name)
        n = 2 * ctx.n_layers * ctx.n_heads * ctx.n_tokens * ctx.head_dim
        pad = {k: (sec[k] + bytes(n))[:n] for k in ("k", "v")}
        return KVSequence(tensor_from_bytes(pad["k"], ctx.dtype, ctx.shape), tensor_from_bytes(pad["v"], ctx.dtype, ctx.shape))


def _bomb(coder: str, size: int) -> bytes:
    """A section of the general-purpose ``coder`` that inflates to ``size`` zero bytes."""
    import lzma
    import zlib

    if coder == "zlib":  # one flushed block of zeros, repeated: a valid raw deflate stream of any length
        c = zlib.compressobj(1, wbits=-15)
        block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
        return block * (size >> 20) + c.flush()
    c = lzma.LZMACompressor(format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 0}])
    return b"".join(c.compress(bytes(1 << 24)) for _ in range(size >> 24)) + c.flush()


@pytest.mark.parametrize("coder", ["zlib", "lzma"])
def test_a_decompression_bomb_is_refused_before_it_inflates(coder):
    """A byte plane of the general-purpose coders that inflates to 128 MiB where the declared shape holds 40 KB
    is refused with a BitstreamError inside a 48 MiB address-space budget, which a valid decode fits."""
    case = build(f"lossless/{coder}")
    name, secs = _parse(case.stream.data)
    with bounded(memory=48 << 20):
        case.decode(case.stream.data)
    bomb = _bomb(coder, 128 << 20)
    data = Bitstream.pack(name, {**secs, "k.mant": (bomb, _bits(bomb))}).data
    with pytest.raises(BitstreamError, match="k.mant"), bounded(memory=48 << 20):
        case.decode(data)


def test_the_oracle_catches_what_it_should():
    """The oracle itself: a library's exception, a silent structural change and an allocation past the budget
    are failures; a check's error and an ignored extra section are not."""
    import numpy as np

    case = build("identity")
    name, secs = _parse(case.stream.data)
    extra = Bitstream.pack(name, {**secs, "extra": (b"\x01", 8)}).data
    assert judge(case, Mutation("add", "extra", extra), "oracle") == "no-op"
    short = Bitstream.pack(name, {**secs, "k": (secs["k"][0][:-2], 8 * (len(secs["k"][0]) - 2))}).data
    assert judge(case, Mutation("truncate", "k", short), "oracle").startswith("rejected")
    with pytest.raises(MemoryError), bounded():
        np.ones(MEMORY * 2, dtype=np.uint8)
    try:
        np.zeros(3).reshape(2, 2)
    except ValueError as e:
        assert not _raised_by_a_raise_statement(e)[0]
    with pytest.raises(pytest.fail.Exception, match="decoded silently"):
        judge(dataclasses.replace(case, decoder=_Lax()), Mutation("truncate", "k", short), "oracle")
    # the known limit is one word exactly: two words past delta's range-coded planes are refused
    delta = build("delta")
    dname, dsecs = _parse(delta.stream.data)
    for extra, outcomes in ((4, {"known limit", "no-op"}), (8, {"rejected: BitstreamError"})):
        raw = dsecs["k.residual"][0] + bytes(range(1, extra + 1))
        data = Bitstream.pack(dname, {**dsecs, "k.residual": (raw, _bits(raw))}).data
        assert judge(delta, Mutation("extend", f"k.residual (+{extra} bytes)", data), "oracle") in outcomes
    swapped = Bitstream.pack(name, {"k": secs["v"], "v": secs["k"]}).data
    assert Mutation("swap", "k<->v", swapped, "payload").kind == "payload"
    assert judge(case, Mutation("swap", "k<->v", swapped, "payload"), "oracle") == "decoded"
