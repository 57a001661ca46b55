"""Group Relative Policy Optimisation (GRPO) with off-policy corrections."""

from __future__ import annotations

import torch

from megatron_rlhf.losses._common import check_tokens, clipped_policy_loss, resolve_denominators

__all__ = ["grpo_loss"]


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float = 0.2, clip_eps_high: float | None = None,
              ref_logprobs: torch.Tensor | None = None, kl_beta: float = 0.0,
              generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
              is_correction: str = "token_tis", is_bounds: tuple[float, float] | None = None,
              kl_estimator: str = "k3", loss_agg: str = "sequence_sum", entropy: torch.Tensor | None = None,
              entropy_coef: float = 0.0, global_num_sequences: float | None = None,
              global_num_tokens: float | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: clipped per-token ratio with group-relative sequence advantages.

    Shao et al. 2024 (DeepSeekMath), eq. 3, as used by Lanchantin et al. 2025, eq. 1::

        r_it = pi_theta(y_it | x, y_i<t) / pi_old(y_it | x, y_i<t)
        L = agg_{i,t}[ w_it * max(-A_i r_it, -A_i clip(r_it, 1-eps, 1+eps_high)) ]
            + kl_beta * agg_{i,t}[ k(pi_theta || pi_ref)_it ]  - entropy_coef * agg(H_it)

    ``A_i`` from :func:`megatron_rlhf.losses.advantages.group_relative_advantages` (computed on the
    whole batch). Default aggregation ``sequence_sum`` is NO length normalisation
    (``sum_{i,t} / N``; Liu et al. 2025 Dr. GRPO); ``sequence_token_mean`` is Shao et al.'s
    ``1/|o_i|`` per-sequence mean; ``token_mean`` divides by the batch's token count (DAPO).
    ``w_it`` (detached) corrects pi_old against the generator's sampling distribution
    (``is_correction``, :func:`~megatron_rlhf.losses._common.offpolicy_weights`; the default
    ``token_tis`` is ``min(pi_old/pi_gen, tis_cap)``); the KL uses Schulman's ``kl_estimator``
    (default k3, :func:`~megatron_rlhf.losses._common.kl_estimate`). With the KL in the reward
    instead (algorithm.kl_in_reward), the learner folds it into the rewards before the advantages
    and calls this with ``kl_beta=0``.

    Gradient flows through ``logprobs`` (and ``entropy``) only.

    Args:
        logprobs: ``[B, T]`` current-policy token logprobs (nats), with grad.
        old_logprobs: ``[B, T]`` pi_old: the learner's recompute before the batch's first update.
        advantages: ``[B]`` sequence advantages.
        mask: ``[B, T]`` float completion mask.
        clip_eps: clip epsilon (algorithm.clip_eps); clip_eps_high: upper epsilon (None = clip_eps).
        ref_logprobs: ``[B, T]`` reference logprobs (needed when ``kl_beta > 0``; else metrics only).
        kl_beta: KL-to-reference coefficient (algorithm.kl_beta), 0 disables.
        generator_logprobs: ``[B, T]`` vLLM sampling logprobs (gap metric; TIS with ``tis_cap``).
        tis_cap: truncated IS cap (algorithm.tis_cap); None with ``token_tis`` disables.
        is_correction: ``none`` | ``token_tis`` | ``token_mask`` | ``sequence_tis`` |
            ``sequence_mask`` (algorithm.is_correction); is_bounds: ``(lo, hi)`` of the masks.
        kl_estimator: ``k1`` | ``k2`` | ``k3`` (algorithm.kl_estimator).
        loss_agg: ``sequence_sum`` | ``sequence_token_mean`` | ``token_mean`` (algorithm.loss_agg).
        entropy: ``[B, T]`` per-token policy entropy (nats) or None; entropy_coef: bonus coefficient.
        global_num_sequences: sequences in the whole batch (all micro-batches/DP ranks); None = B.
        global_num_tokens: completion tokens in the whole batch; None = ``mask.sum()``.
    Returns:
        ``(loss, metrics)``; metrics (detached): ``loss/total``, ``loss/policy``, ``loss/kl_ref``,
        ``loss/entropy_bonus``, ``pg/clip_frac``, ``pg/ratio_{mean,min,max}``,
        ``pg/ratio_outside_frac``, ``pg/approx_kl_old``, ``kl/ref_k{1,2,3}``,
        ``adv/mean``, ``adv/std``, ``entropy/mean``, ``is/*``, ``tis/*``, ``logprobs/gen_gap_abs_mean`` (those
        whose inputs are given).
    Raises:
        ValueError: shapes, unknown ``loss_agg``, negative coefficients, or missing inputs the
            options need.
    """
    check_tokens("grpo_loss", mask, logprobs=logprobs, old_logprobs=old_logprobs,
                 ref_logprobs=ref_logprobs, generator_logprobs=generator_logprobs, entropy=entropy)
    if advantages.shape != (mask.shape[0],):
        raise ValueError(f"grpo_loss: advantages must be [B]={mask.shape[0]} (one per sequence); "
                         f"got {tuple(advantages.shape)}")
    n_seq, n_tok = resolve_denominators("grpo_loss", mask, global_num_sequences, global_num_tokens)
    adv = advantages.detach().to(logprobs.dtype)
    loss, metrics = clipped_policy_loss(
        logprobs, old_logprobs, adv[:, None].expand_as(mask), mask, clip_eps=clip_eps,
        clip_eps_high=clip_eps_high, loss_agg=loss_agg, num_sequences=n_seq, num_tokens=n_tok,
        ref_logprobs=ref_logprobs, kl_beta=kl_beta, generator_logprobs=generator_logprobs,
        tis_cap=tis_cap, is_correction=is_correction, is_bounds=is_bounds, kl_estimator=kl_estimator,
        entropy=entropy, entropy_coef=entropy_coef)
    metrics["adv/mean"] = adv.mean()
    metrics["adv/std"] = adv.std(unbiased=False)
    return loss, metrics
