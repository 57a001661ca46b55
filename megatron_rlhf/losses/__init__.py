"""RL losses: pure functions of tensors returning ``(loss, metrics)``, registered by name.
They import torch and each other only: no config, no model, no Ray.
The batch transforms (advantages, pairs) sit beside them in ``losses/advantages.py``.

| name            | per-token inputs                                   | batch transform (advantages.py)        |
|-----------------|----------------------------------------------------|----------------------------------------|
| online_dpo      | sequence logps [P] of policy/ref, chosen lengths   | pairs from rollout/pairs.py            |
| group_dpo       | logprobs, ref_logprobs [B,T] (+ old for GRPO part) | group_dpo_pairs, group_relative_adv.   |
| grpo            | logprobs, old, (ref), (generator) [B,T]            | group_relative_advantages -> [B]       |
| ppo             | logprobs, old, (ref), (gen), values, old_values    | ppo_advantages (KL reward + GAE)       |
| rloo            | logprobs [B,T], (ref for metrics)                  | kl_penalized_rewards, leave_one_out    |
| proximal_rloo   | logprobs, old, (gen), (ref) [B,T]                  | kl_penalized_rewards, leave_one_out    |
| best_of_k_sft   | logprobs [B,T]                                     | best_of_k_mask                         |
"""

from megatron_rlhf.losses.dpo import dpo_loss, group_dpo_loss, online_dpo_loss
from megatron_rlhf.losses.grpo import grpo_loss
from megatron_rlhf.losses.ppo import ppo_loss, ppo_value_loss
from megatron_rlhf.losses.registry import LOSSES
from megatron_rlhf.losses.rloo import proximal_rloo_loss, rloo_loss
from megatron_rlhf.losses.sft import best_of_k_sft_loss

__all__ = ["LOSSES", "best_of_k_sft_loss", "dpo_loss", "group_dpo_loss", "grpo_loss",
           "online_dpo_loss", "ppo_loss", "ppo_value_loss", "proximal_rloo_loss", "rloo_loss"]
