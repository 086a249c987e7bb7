"""Shared fixtures. Unit tests build a tiny random Llama in-process: no download, seconds to run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.core.kv import KVSequence


class CharTokenizer:
    """Bytes as token ids: enough of a tokenizer for the harness's sampling and capture code."""

    bos_token_id = None
    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True):
        return type("Enc", (), {"input_ids": [b % 128 for b in text.encode("utf-8")]})()


class ByteTokenizer:
    """Bytes as ids, with what lm-eval's model class needs beyond :class:`CharTokenizer` (decode, eos)."""

    eos_token_id = 0
    bos_token_id = None
    name_or_path = "bytes"

    def __call__(self, text: str, add_special_tokens: bool = True):
        return type("Enc", (), {"input_ids": [1 + b % 127 for b in text.encode("utf-8")]})()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return 128


#: what every tiny model shares: 2 layers, 4 query heads of 16 channels, the 128 byte ids the test tokenizers give
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             head_dim=16, max_position_embeddings=512)

#: per architecture: its transformers config and model class names and what sets it apart, as config fields
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),  # GQA
    "mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),  # one KV head per query head
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),  # every layer
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2)),  # per-head q_norm / k_norm
    # QK-norm, one KV head (MQA), a local layer then a global one with their own RoPE bases, its own logit scale
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=1, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24)),
    # fused qkv_proj, a sliding window on every layer (Phi-3-mini's 2047, shrunk) and half the channels rotated
    # (Phi-4-mini's partial RoPE, the same model class)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, sliding_window=12, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    # q_norm / k_norm over all heads' channels at once, before the split into heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                                      eos_token_id=2)),
}


def tiny_arch(name: str, seed: int = 0, **config):
    """A tiny random causal LM of architecture ``name`` (a key of :data:`ARCHITECTURES`) in eval mode, built from a
    config (no download) with ``torch.manual_seed(seed)``; ``config`` overrides fields of it."""
    import transformers

    config_class, model_class, own = ARCHITECTURES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**{**_TINY, **own, **config})
    return getattr(transformers, model_class)(cfg).eval()


def tiny_llama(seed: int = 0, layers: int = 2, kv_heads: int = 2, head_dim: int = 16):
    return tiny_arch("llama", seed, num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=head_dim)


def tiny_windows(lengths, seed: int = 7, model_seed: int = 5):
    """A tiny random Llama and one float16 window of random token ids per length, its KV captured from the model:
    ``(model, [KVSequence, ...])``, the ids kept on each."""
    from kvbench.inputs.capture import capture_window

    model = tiny_llama(seed=model_seed)
    g = torch.Generator().manual_seed(seed)

    def window(T: int) -> KVSequence:
        ids = torch.randint(0, 128, (T,), generator=g)
        got = capture_window(model, ids, T, torch.float16)
        return KVSequence(got["k"], got["v"], ids)

    return model, [window(T) for T in lengths]


def letter_corpus(tmp_path: Path, n_docs: int) -> tuple[Path, list[str]]:
    """``n_docs`` documents of random letters in a JSONL file: a window's text is found in exactly one of them."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), size=120)) for _ in range(n_docs)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    return path, docs


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    return CharTokenizer()


@pytest.fixture()
def random_kv():
    def make(L=2, H=2, T=96, D=16, dtype=torch.float16, seed=0):
        g = torch.Generator().manual_seed(seed)
        k = (torch.randn(L, H, T, D, generator=g) * 2 + torch.linspace(-3, 3, D)).to(dtype)  # channel outliers
        v = torch.randn(L, H, T, D, generator=g).to(dtype)
        return KVSequence(k, v, torch.randint(0, 128, (T,), generator=g))

    return make


@pytest.fixture()
def text_file(tmp_path):
    words = ["the", "nation", "shall", "endure", "and", "the", "people", "shall", "prosper", "under", "law", "and", "liberty"]
    g = torch.Generator().manual_seed(1)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (6000,), generator=g).tolist())
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


@pytest.fixture()
def tiny_cfg(tmp_path, text_file, monkeypatch):
    """A config of ``config_name``'s command (default: run) for the tiny model on a small local text file."""
    from kvbench.core.config import compose

    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))

    def make(*overrides: str, config_name: str = "run"):
        cfg = compose([
            "model=hf", "model.path=unused", "dataset=text", f"dataset.path={text_file}",
            "dataset.seq_len=64", "dataset.eval_len=16", "dataset.n_sequences=2", "dataset.n_calib=1",
            f"paths.results={tmp_path / 'results'}", *overrides,
        ], config_name=config_name)
        OmegaConf.set_struct(cfg, False)
        return cfg

    return make


@pytest.fixture()
def tiny_handle(tiny_model, tokenizer):
    from kvbench.inputs.models import ModelHandle

    return ModelHandle.from_loaded(tiny_model, tokenizer, OmegaConf.create({"name": "hf", "source": "hf", "path": "unused"}))


SWEEP_WORDS = ["the", "nation", "shall", "endure", "and", "people", "prosper", "under", "law", "liberty", "of", "all"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama checkpoint with a word-level tokenizer trained on a small corpus, both saved to disk, for
    tests that run the CLI in subprocesses (``model=hf model.path=CKPT dataset=text dataset.path=CORPUS``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny")
    g = torch.Generator().manual_seed(1)
    text = " ".join(SWEEP_WORDS[i] for i in torch.randint(0, len(SWEEP_WORDS), (4000,), generator=g).tolist())
    corpus = root / "corpus.txt"
    corpus.write_text(text)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    ckpt = root / "ckpt"
    fast.save_pretrained(ckpt)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(ckpt)
    return ckpt, corpus
