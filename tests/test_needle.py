"""Why a query-aware eviction method loses needles under the kvpress protocol (results/accuracy.md): on the real
model, which tokens of a planted needle each method keeps when the context is compressed before the question."""

import json

import pytest
import torch

from compressors.eviction.snapkv import SnapKV
from compressors.eviction.streaming_llm import StreamingLLM
from kvbench.measure.evaluation.needle import needle_positions, segment


class OffsetTokenizer:
    """Whitespace words as tokens, with their character offsets."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        import re

        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]

        class Enc:
            input_ids = [hash(text[s:e]) % 1000 for s, e in spans]
            offset_mapping = spans

        return Enc()


def test_the_needle_is_the_answers_tokens_in_the_segment_each_protocol_compresses():
    ex = {"id": 0, "context": "noise noise magic number is 12 34 . noise", "query": " What is it? Answer:",
          "answers": ["12 34"]}
    ids, needle = segment(OffsetTokenizer(), ex, "context_only")
    assert len(ids) == 9 and needle == [5, 6]
    ids, needle = segment(OffsetTokenizer(), ex, "query_aware")
    assert len(ids) == 9 + 4 - 1 and needle == [5, 6]  # the prompt but its last token
    assert needle_positions([(0, 3), (3, 5), (5, 9)], 4, 6) == [1, 2]
    with pytest.raises(ValueError, match="not in its context"):
        segment(OffsetTokenizer(), {**ex, "answers": ["99"]}, "context_only")
    with pytest.raises(ValueError, match="one of"):
        segment(OffsetTokenizer(), ex, "both")


@pytest.mark.integration
def test_snapkv_without_the_question_keeps_the_needle_in_fewer_heads_and_breaks_it_in_others():
    """SmolLM2, the first single-number needle in noise at 1,024 tokens (depth about 0.3), keep 0.5: with the
    question in its observation window SnapKV keeps the whole 7-digit value in more (layer, KV head) pairs than when
    the haystack's tail scores it, and without it some pairs keep part of the value; StreamingLLM keeps no token of
    a needle older than its recent half under either protocol."""
    from kvbench.core.config import compose
    from kvbench.inputs.models import ModelHandle
    from kvbench.measure.evaluation import ruler
    from kvbench.measure.evaluation.needle import needle_kept
    from kvbench.measure.evaluation.tasks import uses_chat_template

    torch.manual_seed(0)
    cfg = compose(["model=smollm2_135m"], "eval")
    handle = ModelHandle(cfg.model, cfg.device)
    path = ruler.ruler_data(handle.tokenizer, "ruler_niah_single_number_noise", 1024, cfg.ruler.per_length, cfg.seed,
                            uses_chat_template(cfg, handle.tokenizer))
    example = json.loads(path.read_text().splitlines()[0])
    methods = {"snapkv": SnapKV(keep=0.5), "streaming_llm": StreamingLLM(keep=0.5)}
    blind = needle_kept(handle, methods, example, "context_only")
    aware = needle_kept(handle, methods, example, "query_aware")
    depth = blind["snapkv"].needle[0] / blind["snapkv"].tokens
    assert len(blind["snapkv"].needle) >= 5 and 0.1 < depth < 0.45
    assert blind["snapkv"].whole < aware["snapkv"].whole
    assert blind["snapkv"].whole < 0.5 and blind["snapkv"].some > 0
    for got in (blind, aware):
        assert not got["streaming_llm"].kept.any()
