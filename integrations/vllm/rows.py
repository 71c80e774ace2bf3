"""vLLM output -> kvckpt rows, in plain Python over vLLM's output attributes (vLLM is not imported).

:func:`rows_from_vllm` reads what ``LLM.generate(..., SamplingParams(n=..., logprobs=0 or more))``
returns: for every ``RequestOutput`` its ``prompt_token_ids`` and ``prompt`` (text, may be
``None``), and for every ``CompletionOutput`` in ``outputs`` its ``token_ids``, ``logprobs`` (one
``{token id: Logprob}`` mapping per sampled token, vLLM's list or ``FlatLogprobs``; the sampled
token is always in it) and ``text``. Each request becomes one group of rows in
:data:`~kvckpt.integrations.vllm.DEFAULT_SCHEMA` form (NeMo-RL's field names), plus the text
fields ``prompt_text`` and ``completion_text``. :class:`~kvckpt.integrations.vllm.RolloutWorker`
builds its rows with the same :func:`make_row` and reads logprobs with :func:`sampled_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvckpt.errors import BadArgument

#: The text fields :func:`rows_from_vllm` adds (declare them as ``("str", "row")`` to store them).
TEXT_FIELDS = ("prompt_text", "completion_text")


def sampled_logprobs(completion: Any, where: str = "completion") -> list[float]:
    """The log-probability vLLM reported for each sampled token of a ``CompletionOutput``.

    Raises:
        BadArgument: the completion has no logprobs (sample with ``SamplingParams(logprobs=0)`` or
            more), a different number of them than tokens, or a position without its sampled token.
    """
    token_ids, steps = list(completion.token_ids), completion.logprobs
    if steps is None:
        raise BadArgument(f"{where} has no logprobs: sample with SamplingParams(logprobs=0) (or more) "
                          "so generation_logprobs can be filled")
    if len(steps) != len(token_ids):
        raise BadArgument(f"{where} has {len(token_ids)} tokens but {len(steps)} logprob positions")
    out = []
    for position, (token, step) in enumerate(zip(token_ids, steps, strict=True)):
        entry = step.get(token) if hasattr(step, "get") else None
        if entry is None:
            raise BadArgument(f"{where}: position {position} has no logprob for its sampled token {token}")
        out.append(float(entry.logprob))
    return out


def make_row(prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float],
             reward: float | None = None, *, prompt_text: str | None = None,
             completion_text: str | None = None) -> dict[str, Any]:
    """One row: ``input_ids`` = prompt + completion; ``generation_logprobs`` 0 on prompt tokens and
    the engine's logprob on completion tokens; ``token_mask`` 1 exactly on completion tokens;
    ``input_lengths``; ``sample_mask`` 1; ``total_reward`` (if given); and the text fields (if given).

    Raises:
        BadArgument: ``logprobs`` is not as long as ``completion_ids``.
    """
    prompt, completion = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
    if len(logprobs) != len(completion):
        raise BadArgument(f"{len(logprobs)} logprobs for {len(completion)} completion tokens")
    row: dict[str, Any] = {
        "input_ids": torch.tensor(prompt + completion, dtype=torch.int64),
        "generation_logprobs": torch.tensor([0.0] * len(prompt) + [float(x) for x in logprobs], dtype=torch.float32),
        "token_mask": torch.tensor([0] * len(prompt) + [1] * len(completion), dtype=torch.int64),
        "input_lengths": torch.tensor(len(prompt) + len(completion), dtype=torch.int64),
        "sample_mask": torch.tensor(1.0, dtype=torch.float32),
    }
    if reward is not None:
        row["total_reward"] = torch.tensor(float(reward), dtype=torch.float32)
    if prompt_text is not None:
        row["prompt_text"] = str(prompt_text)
    if completion_text is not None:
        row["completion_text"] = str(completion_text)
    return row


def rows_from_vllm(request_outputs: Iterable[Any], *,
                   reward: Callable[[Any, Any], float] | None = None,
                   fields: Iterable[str] | None = None) -> list[list[dict[str, Any]]]:
    """Turn vLLM ``RequestOutput``s into one group of rows per request (see :func:`make_row`).

    Args:
        request_outputs: what ``LLM.generate`` returned (one per prompt; ``n`` completions each).
        reward: ``reward(request_output, completion_output) -> float`` fills ``total_reward``.
            Defaults to none (then the rows have no ``total_reward``; add it before committing).
        fields: keep only these field names, e.g. ``buffer.schema.fields`` so the rows match the
            store. Defaults to every field produced (including :data:`TEXT_FIELDS`).

    Returns:
        ``groups[i][j]`` is the row of completion ``j`` of request ``i``: pass ``groups[i]`` to
        ``commit_group`` under request ``i``'s lease.

    Raises:
        BadArgument: a request without ``prompt_token_ids``, or a completion without usable
            logprobs (:func:`sampled_logprobs`).
    """
    keep = None if fields is None else frozenset(fields)
    groups = []
    for i, request in enumerate(request_outputs):
        prompt_ids = getattr(request, "prompt_token_ids", None)
        if prompt_ids is None:
            raise BadArgument(f"request output {i} has no prompt_token_ids")
        rows = []
        for j, completion in enumerate(request.outputs):
            where = f"request output {i} ({getattr(request, 'request_id', '?')}) completion {j}"
            row = make_row(prompt_ids, completion.token_ids, sampled_logprobs(completion, where),
                           None if reward is None else reward(request, completion),
                           prompt_text=getattr(request, "prompt", None) or "",
                           completion_text=completion.text or "")
            rows.append(row if keep is None else {k: v for k, v in row.items() if k in keep})
        groups.append(rows)
    return groups
