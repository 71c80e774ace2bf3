"""vLLM integration: a rollout worker that commits groups to kvckpt, and a tiny model made at run time.

* :class:`RolloutWorker` — leases in, committed groups out, new weights between steps; backends
  ``vllm`` (``vllm.LLM``, CPU build included) and ``transformers`` behind one interface.
* :func:`rows_from_vllm` — your own ``LLM.generate`` output (``RequestOutput``s) as rows to commit.
* :func:`ensure_tiny_model` / :class:`AdditionTask` — a small Qwen2 policy and a byte-level BPE
  tokenizer built locally and cached (no model hub), and the verifiable task they are made for.

vLLM itself is imported only when the ``vllm`` backend is created, so this package imports in an
environment without it (the ``transformers`` backend needs ``transformers`` and ``tokenizers``).
"""

from kvckpt.integrations.vllm.backends import (
    BACKENDS,
    GenerationBackend,
    Sample,
    TransformersBackend,
    VLLMBackend,
    create_backend,
)
from kvckpt.integrations.vllm.rows import TEXT_FIELDS, make_row, rows_from_vllm, sampled_logprobs
from kvckpt.integrations.vllm.stream import Continuation, ProgressRecorder, SequenceState
from kvckpt.integrations.vllm.worker import DEFAULT_SCHEMA, PROGRESS_EVERY_TOKENS, RolloutWorker, stream_leases

from kvckpt.testing.fixtures.tiny_model import AdditionTask, TinyModelSpec, ensure_tiny_model, train_tokenizer

__all__ = [
    "BACKENDS", "DEFAULT_SCHEMA", "PROGRESS_EVERY_TOKENS", "TEXT_FIELDS", "AdditionTask", "Continuation",
    "GenerationBackend", "ProgressRecorder", "RolloutWorker", "Sample", "SequenceState",
    "TinyModelSpec", "TransformersBackend", "VLLMBackend", "create_backend", "ensure_tiny_model", "make_row",
    "rows_from_vllm", "sampled_logprobs", "stream_leases", "train_tokenizer",
]
