"""Direct preference optimisation losses: DPO, Online DPO (+ NLL on the chosen) and GroupDPO."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rlhf.losses._common import check_tokens
from megatron_rlhf.losses.advantages import group_dpo_pairs
from megatron_rlhf.losses.grpo import grpo_loss

__all__ = ["dpo_loss", "group_dpo_loss", "online_dpo_loss"]


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


def online_dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
                    ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float, *,
                    chosen_lengths: torch.Tensor | None = None,
                    rejected_lengths: torch.Tensor | None = None, nll_coef: float = 0.0,
                    global_num_pairs: float | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Online DPO with an optional length-normalised NLL term on the chosen completion.

    Lanchantin et al. 2025, sec. 4.2 (DPO + NLL, after Pang et al. 2024, Iterative RPO, eq. 3)::

        L = 1/N_pairs sum_p [ -log sigmoid(beta * margin_p)  +  nll_coef * ( -log pi(y_c|x) / |y_c| ) ]

    with ``margin_p`` as in :func:`dpo_loss`. With ``nll_coef=0`` and ``global_num_pairs=None`` it
    equals :func:`dpo_loss`. ``global_num_pairs`` (pairs in the whole batch) makes the sum of
    micro-batch losses equal the whole-batch loss.

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: ``[P]``
            sequence logprobs (sum over completion tokens, nats); only the policy ones carry grad.
        beta: DPO temperature (> 0; algorithm.beta).
        chosen_lengths: ``[P]`` completion-token counts of the chosen (needed when ``nll_coef > 0``;
            also logged as ``dpo/chosen_length``).
        rejected_lengths: ``[P]`` or None (logged as ``dpo/rejected_length``).
        nll_coef: weight of the NLL term (>= 0; algorithm.nll_coef).
        global_num_pairs: pair count of the whole batch; None = P.
    Returns:
        ``(loss, metrics)``: the :func:`dpo_loss` metrics plus ``loss/dpo``, ``loss/nll``,
        ``loss/total``, ``dpo/chosen_length``, ``dpo/rejected_length`` (when given).
    Raises:
        ValueError: shapes, ``beta <= 0``, ``nll_coef < 0``, ``nll_coef > 0`` without
            ``chosen_lengths``, a non-positive length, or ``global_num_pairs <= 0``.
    """
    num_pairs = policy_chosen_logps.shape[0] if global_num_pairs is None else global_num_pairs
    if num_pairs <= 0:
        raise ValueError(f"online_dpo_loss: global_num_pairs must be > 0; got {num_pairs}")
    if nll_coef < 0 or (nll_coef > 0 and chosen_lengths is None):
        raise ValueError(f"online_dpo_loss: nll_coef (algorithm.nll_coef) must be >= 0 and needs "
                         f"chosen_lengths; got {nll_coef}")
    for name, t in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
        if t is not None and (t.shape != policy_chosen_logps.shape or bool((t <= 0).any())):
            raise ValueError(f"online_dpo_loss: {name} must be [P] positive token counts; got "
                             f"shape {tuple(t.shape)}")
    mean_loss, metrics = dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                                  ref_rejected_logps, beta)
    p = policy_chosen_logps.shape[0]
    dpo_part = mean_loss * (p / float(num_pairs))
    loss = dpo_part
    metrics["loss/dpo"] = dpo_part.detach()
    if chosen_lengths is not None:
        lengths = chosen_lengths.detach().to(policy_chosen_logps.dtype)
        nll = (-policy_chosen_logps / lengths).sum() / float(num_pairs)
        metrics["loss/nll"] = nll.detach()
        metrics["dpo/chosen_length"] = lengths.mean()
        if nll_coef > 0:
            loss = loss + nll_coef * nll
    if rejected_lengths is not None:
        metrics["dpo/rejected_length"] = rejected_lengths.detach().float().mean()
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def group_dpo_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                   rewards: torch.Tensor, beta: float, *, group_ids: torch.Tensor | None = None,
                   correct_threshold: float = 1.0, global_num_pairs: float | None = None,
                   alpha: float = 0.0, old_logprobs: torch.Tensor | None = None,
                   advantages: torch.Tensor | None = None, **grpo_options: Any
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GroupDPO: DPO over EVERY (correct, incorrect) pair of each prompt group, averaged.

    Lanchantin et al. 2025, eq. 4. Our reading: with ``C_g``/``I_g`` the correct/incorrect
    completions of group ``g`` and ``Pairs = U_g C_g x I_g``::

        L = 1/|Pairs| sum_{(c, r) in Pairs} -log sigmoid(beta [(log pi(y_c) - log pi_ref(y_c))
                                                              - (log pi(y_r) - log pi_ref(y_r))])
            + alpha * L_GRPO

    i.e. the average is over all pairs of the batch (a group with 2 correct and 1 incorrect adds
    exactly 2 pairs). ``L_GRPO`` is :func:`megatron_rlhf.losses.grpo.grpo_loss` on the same rows
    (Lanchantin et al. sec. 4.2, "GroupDPO + GRPO"). Sequence logprobs are masked sums of the
    token logprobs. Keep each group inside one micro-batch and pass ``global_num_pairs`` (from
    :func:`megatron_rlhf.losses.advantages.group_dpo_pairs` on the whole batch) for invariance.

    Args:
        logprobs: ``[B, T]`` policy token logprobs (nats), with grad.
        ref_logprobs: ``[B, T]`` reference token logprobs.
        mask: ``[B, T]`` float completion mask.
        rewards: ``[B]`` (with ``group_ids``) or ``[G, K]`` (rows in row-major order) rewards.
        beta: DPO temperature (> 0; algorithm.beta).
        group_ids: ``[B]`` integer prompt ids, or None for ``[G, K]`` rewards.
        correct_threshold: reward ``>=`` this is correct (algorithm.group_dpo_threshold).
        global_num_pairs: pairs in the whole batch; None = the local count (a batch without pairs
            gives loss 0 with a graph attached).
        alpha: GRPO weight (algorithm.group_dpo_alpha); > 0 needs ``old_logprobs`` and
            ``advantages [B]``.
        **grpo_options: forwarded to ``grpo_loss`` (clip_eps, kl_beta, tis_cap, generator_logprobs,
            loss_agg, entropy, entropy_coef, global_num_sequences, global_num_tokens, ...).
    Returns:
        ``(loss, metrics)``: ``loss/total``, ``loss/dpo``, ``group_dpo/num_pairs``, ``dpo/margin``,
        ``dpo/accuracy``, ``dpo/chosen_reward``, ``dpo/rejected_reward``, ``dpo/chosen_length``,
        ``dpo/rejected_length``; with ``alpha > 0`` also ``loss/grpo`` and the grpo metrics under
        ``grpo/``.
    Raises:
        ValueError: shapes, ``beta <= 0``, ``alpha < 0``, or ``alpha > 0`` without GRPO inputs.
    """
    check_tokens("group_dpo_loss", mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if beta <= 0:
        raise ValueError(f"group_dpo_loss: beta (algorithm.beta) must be > 0; got {beta}")
    if rewards.numel() != mask.shape[0]:
        raise ValueError(f"group_dpo_loss: rewards must hold B={mask.shape[0]} values; got "
                         f"{tuple(rewards.shape)}")
    if alpha < 0 or (alpha > 0 and (old_logprobs is None or advantages is None)):
        raise ValueError(f"group_dpo_loss: alpha (algorithm.group_dpo_alpha) must be >= 0 and > 0 "
                         f"needs old_logprobs and advantages; got {alpha}")
    chosen, rejected = group_dpo_pairs(rewards, group_ids, correct_threshold=correct_threshold)
    zeros = torch.zeros_like(mask)
    seq = (torch.where(mask > 0, logprobs, zeros) * mask).sum(-1)
    ref_seq = (torch.where(mask > 0, ref_logprobs.detach(), zeros) * mask).sum(-1)
    lengths = mask.sum(-1)
    num_pairs = float(chosen.numel()) if global_num_pairs is None else float(global_num_pairs)
    if num_pairs < 0 or (num_pairs == 0 and chosen.numel() > 0):
        raise ValueError(f"group_dpo_loss: global_num_pairs must be >= the local pair count "
                         f"{chosen.numel()}; got {num_pairs}")
    metrics: dict[str, torch.Tensor] = {"group_dpo/num_pairs": mask.new_tensor(float(chosen.numel()))}
    if chosen.numel() > 0:
        dpo_mean, dpo_metrics = dpo_loss(seq[chosen], seq[rejected], ref_seq[chosen],
                                         ref_seq[rejected], beta)
        dpo_part = dpo_mean * (chosen.numel() / num_pairs)
        metrics.update(dpo_metrics)
        metrics["dpo/chosen_length"] = lengths[chosen].mean()
        metrics["dpo/rejected_length"] = lengths[rejected].mean()
    else:
        dpo_part = seq.sum() * 0.0  # no pair here: zero loss, graph kept for a uniform backward
    loss = dpo_part
    metrics["loss/dpo"] = dpo_part.detach()
    if alpha > 0:
        flat_adv = advantages.reshape(-1)
        g_loss, g_metrics = grpo_loss(logprobs, old_logprobs, flat_adv, mask,
                                      ref_logprobs=ref_logprobs, **grpo_options)
        loss = loss + alpha * g_loss
        metrics.update({f"grpo/{k}": v for k, v in g_metrics.items()})
        metrics["loss/grpo"] = (alpha * g_loss).detach()
    metrics["loss/total"] = loss.detach()
    return loss, metrics
