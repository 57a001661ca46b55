"""Direct preference optimisation losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["dpo_loss"]


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss of preference pairs (Online DPO when the pairs are sampled from the policy).

    Implements Rafailov et al. 2023, eq. 7, as used online by Guo et al. 2024 and by
    Noukhovitch et al. 2024 (Asynchronous RLHF, sec. 2, L_DPO)::

        L = -mean_i log sigmoid( beta * [ (log pi(y_c|x) - log pi_ref(y_c|x))
                                          - (log pi(y_r|x) - log pi_ref(y_r|x)) ] )

    Args:
        policy_chosen_logps: ``[P]`` sequence logprobs (sum over completion tokens, nats) of the
            chosen completions under the policy.
        policy_rejected_logps: ``[P]`` same for the rejected completions.
        ref_chosen_logps: ``[P]`` chosen under the frozen reference (no grad).
        ref_rejected_logps: ``[P]`` rejected under the reference.
        beta: DPO temperature (> 0).
    Returns:
        ``(loss, metrics)``: ``loss`` a scalar (mean over the P pairs, so the scale does not
        depend on P); ``metrics`` detached scalars: ``dpo/margin`` (mean beta-scaled reward
        margin), ``dpo/accuracy`` (fraction of pairs with a positive margin),
        ``dpo/chosen_reward`` and ``dpo/rejected_reward`` (mean beta * log-ratio).
    Raises:
        ValueError: shapes differ or ``beta <= 0``.
    """
    shapes = {t.shape for t in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                                ref_rejected_logps)}
    if len(shapes) != 1 or policy_chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss: all inputs must have the same shape [P]; got {shapes}")
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    chosen = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected = beta * (policy_rejected_logps - ref_rejected_logps)
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    metrics = {"dpo/margin": margin.detach().mean(),
               "dpo/accuracy": (margin.detach() > 0).float().mean(),
               "dpo/chosen_reward": chosen.detach().mean(),
               "dpo/rejected_reward": rejected.detach().mean()}
    return loss, metrics
