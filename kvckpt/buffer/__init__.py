"""Layer 6, the buffer: :class:`ReplayBuffer` (the facade that runs one transition per durable
transaction), :class:`AsyncReplayBuffer` (its coroutine form), and the buffer-level entry points
of durability (:func:`checkpoint`, :func:`restore`, :func:`recover`).
"""

from kvckpt.buffer.batch import Batch
from kvckpt.buffer.durable import checkpoint, recover, restore
from kvckpt.buffer.replay_buffer import ReplayBuffer
from kvckpt.transitions.config import BufferConfig

__all__ = ["Batch", "BufferConfig", "ReplayBuffer", "checkpoint", "recover", "restore"]
