"""Realistic GRPO rollouts for the benchmarks, as an async trainer holds them.

A *group* is one prompt rolled out ``group_size`` times. :func:`make_group` returns it the way
NeMo-RL's async GRPO (and most peers) keep it in memory: one dict of arrays padded to the group's
longest row (``[n, L]`` token fields, ``[n]`` per-row fields; :func:`as_tensors` gives the torch
view). kvckpt is handed the same group cut into jagged rows (:func:`rows_of`, via
:func:`kvckpt.split_padded`); the baselines get the padded tensors. "Raw bytes" everywhere in the
benchmarks means the padded tensors' bytes (:func:`raw_bytes`), the memory a trainer's replay
buffer really occupies.

Distributions (one ``numpy.random.Generator``, so a seed reproduces the data exactly):

* prompt length lognormal, median 300 tokens (sigma 0.5, clipped to 32..2048), shared by the
  group's rows;
* response length lognormal, median 900 tokens (sigma 0.8, clipped to 200..4000);
* token ids from a 151,936-entry vocabulary (Qwen2.5): a Zipf law over frequency ranks (exponent
  1.05, 10.9 bits of unigram entropy per token), ranks mapped to ids loosely in frequency order
  (sorted by log-rank plus N(0, 1) noise, as BPE merge order does); drawn i.i.d., so without the
  repetition real text has (a pessimistic case for compression);
* ``generation_logprobs`` float32: the log-probability of the sampled token, median about -0.05
  with a long tail to -20 (temperature-1 sampling); 0 on prompt and padding positions;
* ``token_mask`` int64 (1 on response tokens, as NeMo-RL's ``token_loss_mask``), ``input_ids``
  int64 padded with the pad id 151643; per row ``input_lengths`` int64, ``sample_mask`` and
  ``total_reward`` (0/1) float32.

``python -m benchmarks.codec_bench`` draws its groups from here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from integrations.nemo_rl.config import GRPO_SCHEMA
from kvckpt import RowSchema, split_padded

VOCAB = 151_936
PAD_ID = 151_643
ZIPF_S = 1.05
TOKEN_FIELDS = tuple(name for name, (_, kind) in GRPO_SCHEMA.items() if kind == "token")
ROW_FIELDS = tuple(name for name, (_, kind) in GRPO_SCHEMA.items() if kind == "row")
#: The row schema of every realistic benchmark store: NeMo-RL's GRPO rollout rows.
SCHEMA = RowSchema(GRPO_SCHEMA)
#: The schema of the tiny rows used where only the number of groups matters (select latency).
TINY_SCHEMA = RowSchema({"input_ids": ("int64", "token"), "total_reward": ("float32", "row")})

Group = dict[str, np.ndarray]


@dataclass(frozen=True)
class RolloutSpec:
    """The shape of generated rollouts (medians in tokens, sigmas of the lognormals)."""

    group_size: int = 16
    prompt_median: float = 300
    prompt_sigma: float = 0.5
    prompt_range: tuple[int, int] = (32, 2048)
    response_median: float = 900
    response_sigma: float = 0.8
    response_range: tuple[int, int] = (200, 4000)


def _vocabulary() -> tuple[np.ndarray, np.ndarray]:
    """CDF of the Zipf law over frequency ranks, and the rank -> token id map."""
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    p = ranks ** -ZIPF_S
    cdf = np.cumsum(p / p.sum())
    # BPE ids follow merge order, which follows frequency only loosely: sort by log-rank + noise.
    noise = np.random.default_rng(1234).normal(0.0, 1.0, VOCAB)
    rank_to_id = np.argsort(np.log(ranks) + noise, kind="stable").argsort().astype(np.int64)
    return cdf, rank_to_id


_CDF, _RANK_TO_ID = _vocabulary()


def token_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` i.i.d. token ids (int64) from the vocabulary model above."""
    ranks = np.minimum(np.searchsorted(_CDF, rng.random(n)), VOCAB - 1)
    return _RANK_TO_ID[ranks]


def make_group(rng: np.random.Generator, spec: RolloutSpec = RolloutSpec()) -> Group:
    """One group as the trainer holds it: padded ``[n, L]`` token arrays and ``[n]`` row arrays."""
    n = spec.group_size
    prompt_len = int(np.clip(rng.lognormal(np.log(spec.prompt_median), spec.prompt_sigma), *spec.prompt_range))
    resp = np.clip(rng.lognormal(np.log(spec.response_median), spec.response_sigma, n),
                   *spec.response_range).astype(np.int64)
    lengths = prompt_len + resp
    width = int(lengths.max())
    prompt = token_ids(rng, prompt_len)
    ids = np.full((n, width), PAD_ID, np.int64)
    logprobs = np.zeros((n, width), np.float32)
    mask = np.zeros((n, width), np.int64)
    for i, count in enumerate(resp):
        end = prompt_len + count
        ids[i, :prompt_len] = prompt
        ids[i, prompt_len:end] = token_ids(rng, count)
        logprobs[i, prompt_len:end] = -np.minimum(np.exp(rng.normal(-3.0, 2.5, count)), 20.0)
        mask[i, prompt_len:end] = 1
    return {
        "input_ids": ids,
        "generation_logprobs": logprobs,
        "token_mask": mask,
        "sample_mask": np.ones(n, np.float32),
        "total_reward": (rng.random(n) < 0.4).astype(np.float32),
        "input_lengths": lengths,
    }


def as_tensors(group: Group, copy: bool = False) -> dict[str, torch.Tensor]:
    """The group as torch tensors (sharing its memory unless ``copy``)."""
    return {k: torch.from_numpy(v.copy() if copy else v) for k, v in group.items()}


def raw_bytes(group: Group) -> int:
    """Bytes of the group's padded tensors (what a trainer's in-memory buffer holds)."""
    return sum(a.nbytes for a in group.values())


def unpadded_bytes(group: Group) -> int:
    """Bytes of the group's jagged rows (padding dropped): what kvckpt counts as ``raw_bytes``."""
    tokens = int(group["input_lengths"].sum())
    per_token = sum(group[f].itemsize for f in TOKEN_FIELDS)
    per_row = sum(group[f].itemsize for f in ROW_FIELDS)
    return tokens * per_token + len(group["input_lengths"]) * per_row


def rows_of(group: Group) -> list[dict[str, np.ndarray]]:
    """The group as jagged rows (views of the padded tensors), as producers commit them to kvckpt."""
    return split_padded(group, group["input_lengths"], SCHEMA)


def response_tokens(group: Group) -> int:
    """Generated tokens in the group (the generation work it represents)."""
    return int(group["token_mask"].sum())


def iter_groups(target_raw_bytes: int, seed: int, spec: RolloutSpec = RolloutSpec()) -> Iterator[Group]:
    """Groups until their raw bytes reach ``target_raw_bytes``; the same seed gives the same groups."""
    rng = np.random.default_rng(seed)
    total = 0
    while total < target_raw_bytes:
        group = make_group(rng, spec)
        total += raw_bytes(group)
        yield group


def tiny_rows(group_size: int, seed: int) -> list[dict[str, np.ndarray]]:
    """A group of tiny rows (16 tokens): for benchmarks where only the number of groups matters."""
    rng = np.random.default_rng(seed)
    return [{"input_ids": token_ids(rng, 16), "total_reward": np.float32(rng.random() < 0.5)}
            for _ in range(group_size)]
