"""vLLM integration: a rollout worker that commits groups to kvckpt, and a tiny model made at run time.

* :class:`RolloutWorker` — leases in, committed groups out, new weights between steps; backends
  ``vllm`` (``vllm.LLM``, CPU build included) and ``transformers`` behind one interface.
* :func:`rows_from_vllm` — your own ``LLM.generate`` output (``RequestOutput``s) as rows to commit.
* :func:`ensure_tiny_model` / :class:`AdditionTask` — a small Qwen2 policy and a byte-level BPE
  tokenizer built locally and cached (no model hub), and the verifiable task they are made for.

vLLM itself is imported only when the ``vllm`` backend is created, so this package imports in an
environment without it (the ``transformers`` backend needs ``transformers`` and ``tokenizers``).
"""

from kvckpt.integrations.vllm.rows import TEXT_FIELDS, make_row, rows_from_vllm, sampled_logprobs
from kvckpt.integrations.vllm.tiny_model import AdditionTask, TinyModelSpec, ensure_tiny_model, train_tokenizer
from kvckpt.integrations.vllm.worker import (
    BACKENDS,
    DEFAULT_SCHEMA,
    GenerationBackend,
    RolloutWorker,
    Sample,
    TransformersBackend,
    VLLMBackend,
    create_backend,
)

__all__ = [
    "BACKENDS", "DEFAULT_SCHEMA", "TEXT_FIELDS", "AdditionTask", "GenerationBackend", "RolloutWorker", "Sample",
    "TinyModelSpec", "TransformersBackend", "VLLMBackend", "create_backend", "ensure_tiny_model", "make_row",
    "rows_from_vllm", "sampled_logprobs", "train_tokenizer",
]
