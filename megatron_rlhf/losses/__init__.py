"""RL losses: pure functions of tensors returning ``(loss, metrics)``."""

from megatron_rlhf.losses.dpo import dpo_loss

__all__ = ["dpo_loss"]
