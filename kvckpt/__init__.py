"""kvckpt: a crash-consistent replay buffer and checkpoint store for async RL post-training."""
