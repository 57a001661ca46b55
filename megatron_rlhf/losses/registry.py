"""Name -> loss function registry (the values of ``algorithm.loss``).

The functions have different inputs (see each docstring and the table in
``megatron_rlhf/losses/__init__.py``), so the learner dispatches per name; the registry is the
single list of valid names and lets config validation and tests enumerate them.
"""

from __future__ import annotations

from typing import Callable

from megatron_rlhf.losses.dpo import group_dpo_loss, online_dpo_loss
from megatron_rlhf.losses.grpo import grpo_loss
from megatron_rlhf.losses.ppo import ppo_loss
from megatron_rlhf.losses.rloo import proximal_rloo_loss, rloo_loss
from megatron_rlhf.losses.sft import best_of_k_sft_loss

__all__ = ["LOSSES"]

LOSSES: dict[str, Callable[..., tuple]] = {
    "online_dpo": online_dpo_loss,
    "group_dpo": group_dpo_loss,
    "grpo": grpo_loss,
    "ppo": ppo_loss,
    "rloo": rloo_loss,
    "proximal_rloo": proximal_rloo_loss,
    "best_of_k_sft": best_of_k_sft_loss,
}
"""``algorithm.loss`` name -> ``fn(...) -> (loss, metrics)``."""
