"""PPO for RLHF: clipped per-token policy objective plus a clipped value loss.

Advantages and returns come from :func:`megatron_rlhf.losses.advantages.ppo_advantages` (KL-shaped
token rewards + GAE), computed once per batch with the OLD critic's values.
"""

from __future__ import annotations

import torch

from megatron_rlhf.losses._common import (aggregate, check_tokens, clipped_policy_loss, masked_mean,
                                          resolve_denominators)

__all__ = ["ppo_loss", "ppo_value_loss"]


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                   mask: torch.Tensor, *, value_clip_eps: float | None = 0.2,
                   loss_agg: str = "token_mean", global_num_sequences: float | None = None,
                   global_num_tokens: float | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.

    Value clipping as in the PPO reference implementation (Huang et al. 2022, "37 implementation
    details of PPO", detail 9; Ouyang et al. 2022 critic; TRL ``PPOTrainer``). ``value_clip_eps=None``
    gives the plain squared error ``0.5 (V - R)^2``.

    Args:
        values: ``[B, T]`` current critic values V_phi(s_t), with grad.
        old_values: ``[B, T]`` critic values at rollout time (those used by GAE).
        returns: ``[B, T]`` value targets ``A_gae + V_old`` (before whitening).
        mask: ``[B, T]`` float mask.
        value_clip_eps: clip range in reward units (algorithm.value_clip_eps), None disables.
        loss_agg, global_num_sequences, global_num_tokens: see ``grpo_loss``.
    Returns:
        ``(loss, metrics)``: ``value/loss``, ``value/clip_frac`` (tokens where the clipped error
        is the larger), ``value/pred_mean``, ``value/return_mean``, ``value/abs_error``.
    Raises:
        ValueError: shapes or ``value_clip_eps <= 0``.
    """
    check_tokens("ppo_value_loss", mask, values=values, old_values=old_values, returns=returns)
    if value_clip_eps is not None and value_clip_eps <= 0:
        raise ValueError(f"ppo_value_loss: value_clip_eps (algorithm.value_clip_eps) must be > 0 or "
                         f"null; got {value_clip_eps}")
    n_seq, n_tok = resolve_denominators("ppo_value_loss", mask, global_num_sequences,
                                        global_num_tokens)
    zeros = torch.zeros_like(mask)
    v = torch.where(mask > 0, values, zeros)
    v_old = torch.where(mask > 0, old_values.detach(), zeros)
    ret = torch.where(mask > 0, returns.detach(), zeros)
    err = (v - ret) ** 2
    if value_clip_eps is None:
        per_token = 0.5 * err
        clip_frac = mask.new_zeros(())
    else:
        v_clip = v_old + (v - v_old).clamp(-value_clip_eps, value_clip_eps)
        err_clip = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clip_frac = masked_mean((err_clip > err).to(mask.dtype), mask)
    loss = aggregate(per_token, mask, loss_agg, n_seq, n_tok)
    return loss, {"value/loss": loss.detach(), "value/clip_frac": clip_frac,
                  "value/pred_mean": masked_mean(v, mask), "value/return_mean": masked_mean(ret, mask),
                  "value/abs_error": masked_mean((v - ret).abs(), mask)}


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, clip_eps: float = 0.2, clip_eps_high: float | None = None,
             values: torch.Tensor | None = None, old_values: torch.Tensor | None = None,
             returns: torch.Tensor | None = None, value_clip_eps: float | None = 0.2,
             value_coef: float = 0.5, ref_logprobs: torch.Tensor | None = None,
             generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
             is_correction: str = "token_tis", is_bounds: tuple[float, float] | None = None,
             kl_beta: float = 0.0, kl_estimator: str = "k3", loss_agg: str = "token_mean",
             entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
             global_num_sequences: float | None = None, global_num_tokens: float | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip for RLHF: ``L = L_clip + value_coef * L_V - entropy_coef * H``.

    Schulman et al. 2017, eq. 7 (clipped surrogate, per token, with GAE advantages ``A_t`` from
    Schulman et al. 2016 eq. 16) and eq. 9 (combined objective); Ouyang et al. 2022, eq. 2 (the KL
    to the reference is by default a per-token penalty in the REWARD, ``kl_beta=0`` here and
    ``ref_logprobs`` only feeds the ``kl/ref_*`` metrics; ``algorithm.kl_in_reward: false`` moves
    it into the loss: ``+ kl_beta * agg(k(pi_theta || pi_ref))`` with ``kl_estimator``). The ratio
    is pi_theta/pi_old; ``is_correction`` / ``tis_cap`` / ``is_bounds`` weight it against the
    generator (see ``grpo_loss``). The value term needs ``values``,
    ``old_values`` and ``returns`` together (the critic has its own parameters; its gradient comes
    only from the value term). Default aggregation ``token_mean`` (TRL PPO's masked mean).

    Args:
        logprobs, old_logprobs, mask: ``[B, T]`` (see ``grpo_loss``).
        advantages: ``[B, T]`` per-token advantages (GAE, possibly whitened).
        clip_eps, clip_eps_high: policy clip range (algorithm.clip_eps).
        values, old_values, returns: ``[B, T]`` or all None (policy-only loss).
        value_clip_eps: value clip range (algorithm.value_clip_eps); value_coef: weight of the value
            loss (algorithm.value_coef).
        ref_logprobs, generator_logprobs, tis_cap, is_correction, is_bounds, kl_beta, kl_estimator,
        loss_agg, entropy, entropy_coef, global_num_sequences, global_num_tokens: see ``grpo_loss``.
    Returns:
        ``(loss, metrics)``: the ``grpo_loss`` metric set plus ``value/*`` and ``loss/value``.
    Raises:
        ValueError: shapes, only some of the value inputs given, bad coefficients.
    """
    check_tokens("ppo_loss", mask, logprobs=logprobs, old_logprobs=old_logprobs,
                 advantages=advantages, ref_logprobs=ref_logprobs,
                 generator_logprobs=generator_logprobs, entropy=entropy)
    given = [t is not None for t in (values, old_values, returns)]
    if any(given) and not all(given):
        raise ValueError("ppo_loss: values, old_values and returns must be given together "
                         f"(got values={given[0]}, old_values={given[1]}, returns={given[2]})")
    if value_coef < 0:
        raise ValueError(f"ppo_loss: value_coef (algorithm.value_coef) must be >= 0; got {value_coef}")
    n_seq, n_tok = resolve_denominators("ppo_loss", mask, global_num_sequences, global_num_tokens)
    loss, metrics = clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        loss_agg=loss_agg, num_sequences=n_seq, num_tokens=n_tok, ref_logprobs=ref_logprobs,
        kl_beta=kl_beta, generator_logprobs=generator_logprobs, tis_cap=tis_cap,
        is_correction=is_correction, is_bounds=is_bounds, kl_estimator=kl_estimator, entropy=entropy,
        entropy_coef=entropy_coef)
    metrics["adv/mean"] = masked_mean(advantages, mask)
    metrics["adv/std"] = torch.sqrt(masked_mean((advantages.detach() - metrics["adv/mean"]) ** 2, mask))
    if all(given):
        v_loss, v_metrics = ppo_value_loss(values, old_values, returns, mask,
                                           value_clip_eps=value_clip_eps, loss_agg=loss_agg,
                                           global_num_sequences=n_seq, global_num_tokens=n_tok)
        loss = loss + value_coef * v_loss
        metrics.update(v_metrics)
        metrics["loss/value"] = (value_coef * v_loss).detach()
        metrics["loss/total"] = loss.detach()
    return loss, metrics
