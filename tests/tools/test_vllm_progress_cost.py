"""The vLLM progress-cost benchmark's edge and owner do what it claims, without vLLM: every step
message the edge sends is recorded durably by the owner process before the edge's clock stops.

``benchmarks/vllm_progress_cost.py`` runs in ``.venv-vllm``; its ``Edge`` and ``serve`` need only
kvckpt, so this drives them with hand-made engine steps and then reads the store in this process.
"""

from __future__ import annotations

import numpy as np
from kvckpt.integrations.vllm import DEFAULT_SCHEMA

from benchmarks.vllm_progress_cost import GROUP, Edge, start_other_end
from kvckpt import BufferConfig, ProgressEncoder, ReplayBuffer


def test_every_step_message_the_edge_sends_is_durable_when_it_finishes(tmp_path):
    config = BufferConfig(group_size=GROUP, schema=DEFAULT_SCHEMA, max_buffered_rollouts=2)
    proc, port, leases = start_other_end(str(tmp_path), "owner", config, 2)
    sequences = 2 * GROUP
    edge = Edge(ProgressEncoder.from_config(config.to_dict()),
                [(leases[i // GROUP], i % GROUP) for i in range(sequences)], 3, port)
    for step in range(7):  # sequence i stops after 7 - i % 2 tokens: uneven last chunks
        edge.on_step([(i, [100 * i + step], [-0.5]) for i in range(sequences) if step < 7 - i % 2])
    edge.finish()
    assert proc.wait(timeout=60) == 0
    assert edge.steps == 7 and edge.sent == 3 and edge.acked == 3  # at steps 3 and 6, then the rest
    [store] = [p for p in tmp_path.iterdir() if p.name.endswith(".kv")]
    with ReplayBuffer.open(str(store)) as buf:
        for i in range(sequences):
            got = buf.progress(leases[i // GROUP])[i % GROUP]
            assert got.tokens.tolist() == [100 * i + s for s in range(7 - i % 2)]
            assert np.allclose(got.logprobs.numpy(), -0.5)
