"""A tiny Qwen2-style policy and its byte-level BPE tokenizer, made at run time (no model hub).

The reference trainer and the tests need a real causal LM that both vLLM (CPU build) and
transformers load from a directory. :func:`ensure_tiny_model` builds one the first time and caches
it on disk: a random-weight Qwen2 (hidden 256, 4 heads, 2 KV heads, head_dim 64 — vLLM's CPU
attention refuses small head dims —, 2 layers, vocab 1024, tied embeddings) and a byte-level BPE
tokenizer trained by ``tokenizers`` on synthetic lines of :class:`AdditionTask`, saved as a
``PreTrainedTokenizerFast``. The directory name carries a digest of everything that shapes the
files, so a changed recipe never reuses a stale cache; it is written under a temporary name and
renamed, so a crash mid-build never leaves a half-made model behind the final name.

The task lives here too because the tokenizer is trained on its lines: "a+b=" prompts whose
verifiable answer is the decimal sum.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kvckpt", "tiny-model")


@dataclass(frozen=True)
class TinyModelSpec:
    """What shapes the tiny model's files; its digest names the cache directory.

    Args:
        vocab_size: model vocabulary (the tokenizer's is at most this). Defaults to 1024.
        hidden_size: Defaults to 256.
        intermediate_size: MLP width. Defaults to 512.
        num_hidden_layers: Defaults to 2.
        num_attention_heads: Defaults to 4.
        num_key_value_heads: Defaults to 2.
        head_dim: Defaults to 64 (vLLM's CPU attention needs about 64).
        max_position_embeddings: Defaults to 256.
        seed: seeds the random weights and the tokenizer corpus. Defaults to 0.
        corpus_lines: synthetic lines the tokenizer is trained on. Defaults to 4000.
        max_operand: the task's operands range over ``0..max_operand``. Defaults to 9.
    """

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 256
    seed: int = 0
    corpus_lines: int = 4000
    max_operand: int = 9

    def digest(self) -> str:
        """A short stable digest of every field (the cache key)."""
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class AdditionTask:
    """Single-digit (by default) addition: prompt ``"a+b="``, answer ``str(a + b)``.

    Prompt ``prompt_idx`` is a pure function of ``(seed, prompt_idx)``: every epoch over the
    ``(max_operand + 1) ** 2`` pairs is a fresh seeded permutation, so a redispatched lease (which
    carries only ``prompt_idx``) regenerates exactly the same prompt.

    Args:
        max_operand: operands range over ``0..max_operand``. Defaults to 9.
        seed: the dataset order's seed. Defaults to 0.
    """

    max_operand: int = 9
    seed: int = 0

    @property
    def size(self) -> int:
        """Distinct prompts in one epoch."""
        return (self.max_operand + 1) ** 2

    def operands(self, prompt_idx: int) -> tuple[int, int]:
        """The ``(a, b)`` of prompt ``prompt_idx``."""
        epoch, pos = divmod(int(prompt_idx), self.size)
        order = list(range(self.size))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return divmod(order[pos], self.max_operand + 1)

    def prompt(self, prompt_idx: int) -> str:
        """The prompt text of ``prompt_idx``."""
        a, b = self.operands(prompt_idx)
        return f"{a}+{b}="

    def answer(self, prompt_idx: int) -> str:
        """The correct completion text of ``prompt_idx`` (without end-of-text)."""
        a, b = self.operands(prompt_idx)
        return str(a + b)

    def reward(self, prompt_idx: int, completion: str) -> float:
        """1.0 when the completion (special tokens stripped, surrounding space ignored) is exactly
        the answer, else 0.0."""
        return 1.0 if completion.strip() == self.answer(prompt_idx) else 0.0

    def corpus(self, lines: int, seed: int) -> list[str]:
        """Synthetic text the tokenizer is trained on: equations with operands up to 99 (so the
        BPE learns multi-digit tokens) mixed with this task's own lines."""
        rng = random.Random(seed)
        out = []
        for i in range(lines):
            hi = self.max_operand if i % 2 else 99
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            out.append(f"{a}+{b}={a + b}")
        return out


def ensure_tiny_model(cache_dir: str | None = None, spec: TinyModelSpec | None = None) -> str:
    """The directory of the tiny model (config, safetensors weights, tokenizer), built if missing.

    Args:
        cache_dir: parent directory of the cache. Defaults to ``~/.cache/kvckpt/tiny-model``.
        spec: the model recipe. Defaults to :class:`TinyModelSpec()`.

    Returns:
        ``<cache_dir>/<spec digest>``, complete (built under a temporary name, then renamed).
    """
    spec = spec or TinyModelSpec()
    parent = os.path.abspath(cache_dir or DEFAULT_CACHE)
    final = os.path.join(parent, spec.digest())
    if os.path.isfile(os.path.join(final, "spec.json")):
        return final
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=parent)
    try:
        _build(tmp, spec)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "spec.json")):  # not a concurrent builder's win
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _build(path: str, spec: TinyModelSpec) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(AdditionTask(spec.max_operand, spec.seed).corpus(spec.corpus_lines, spec.seed),
                                spec.vocab_size)
    tokenizer.save_pretrained(path)
    eos, pad = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    config = Qwen2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = pad
    model.save_pretrained(path)
    with open(os.path.join(path, "spec.json"), "w") as fh:
        json.dump(asdict(spec), fh, indent=1, sort_keys=True)


def train_tokenizer(lines: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``lines``, as a ``PreTrainedTokenizerFast`` of exactly
    ``vocab_size`` tokens whose end-of-text token also serves as BOS/EOS and ``<|pad|>`` as padding.

    Byte-level pre-tokenization splits digits from operators, so no merge ever spans the
    ``=`` between a prompt and its answer: a prompt tokenized alone is a prefix of the full line.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    eos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=pad,
                                        padding_side="left")
    # Fill the vocabulary up with reserved special tokens: every id an untrained model can sample
    # then decodes (to nothing) instead of being out of the detokenizer's range.
    tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(len(tokenizer), vocab_size)], special_tokens=True)
    return tokenizer
