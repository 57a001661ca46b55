"""REINFORCE Leave-One-Out (RLOO) and its proximal (clipped-ratio) variant.

Advantages come from :func:`megatron_rlhf.losses.advantages.leave_one_out_advantages`, optionally on
KL-penalised rewards (:func:`megatron_rlhf.losses.advantages.kl_penalized_rewards`), computed once
per batch.

Reading of Noukhovitch et al. 2024 (Asynchronous RLHF), App. B "Proximal RLOO": plain RLOO is a
REINFORCE estimator and is only valid on-policy; for off-policy (asynchronous) samples and several
updates per batch the paper applies PPO's clipped surrogate to the RLOO advantage, with the ratio
pi_theta/pi_old. Because RLOO models the whole completion as ONE action (Ahmadian et al. 2024,
sec. 3.1-3.3), our default (``level="sequence"``) uses the sequence ratio
``pi_theta(y|x)/pi_old(y|x) = exp(sum_t logp_t - logp_old_t)``; ``level="token"`` gives the per-token
PPO form (every token of completion i gets ``A_i``), the variant most implementations use (e.g. TRL's
``RLOOTrainer``). We could not re-check the appendix text in this session, so both are offered and
tested; the config picks one explicitly.
"""

from __future__ import annotations

import torch

from megatron_rlhf.losses._common import (_MAX_LOG_RATIO, aggregate, check_tokens,
                                          clipped_policy_loss, k3_kl, masked_mean,
                                          resolve_denominators, truncated_is_weights)

__all__ = ["proximal_rloo_loss", "rloo_loss"]


def _check_adv(fn: str, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if advantages.shape != (mask.shape[0],):
        raise ValueError(f"{fn}: advantages must be [B]={mask.shape[0]}; got {tuple(advantages.shape)}")
    return advantages.detach().to(mask.dtype)


def rloo_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              entropy_coef: float = 0.0, loss_agg: str = "sequence_sum",
              global_num_sequences: float | None = None, global_num_tokens: float | None = None,
              generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO: REINFORCE on the sequence logprob with a leave-one-out baseline, with truncated
    importance sampling against the generator when its samples are off-policy.

    Ahmadian et al. 2024, sec. 3.3, eq. 6: ``L = -1/N sum_i A_i log pi_theta(y_i | x)`` with
    ``log pi(y_i|x) = sum_t m_it logp_it`` (the default ``sequence_sum`` aggregation) and
    ``A_i = R_i - mean_{j != i} R_j``. REINFORCE is an on-policy estimator; asynchronous samples
    come from an older policy (staleness >= 1) and from vLLM's numerics, so with ``tis_cap`` each
    token's term is weighted by ``w_it = min(pi_theta(y_it)/pi_gen(y_it), tis_cap)`` (detached:
    the off-policy REINFORCE gradient ``E_gen[pi_theta/pi_gen A grad log pi_theta]``, truncated
    per token as IMPALA's rho, Espeholt et al. 2018 eq. 1, and the TIS of the other
    policy-gradient losses; :func:`~megatron_rlhf.losses._common.truncated_is_weights` with
    pi_theta in the place of pi_old)::

        L = agg_i,t( -A_i w_it logp_it )

    No clipping (use ``proximal_rloo_loss`` for that). Gradient flows through ``logprobs`` (and
    ``entropy``).

    Args:
        logprobs: ``[B, T]`` current-policy token logprobs, with grad.
        advantages: ``[B]`` leave-one-out advantages.
        mask: ``[B, T]`` float completion mask.
        ref_logprobs: ``[B, T]`` or None (``kl/ref_*`` metrics only; the KL belongs in the reward).
        entropy, entropy_coef, loss_agg, global_num_sequences, global_num_tokens: see ``grpo_loss``.
        generator_logprobs: ``[B, T]`` vLLM sampling logprobs (needed with ``tis_cap``; tokens
            whose value is not finite are dropped and counted).
        tis_cap: truncation of the importance weight (algorithm.tis_cap); None: plain RLOO.
    Returns:
        ``(loss, metrics)``: ``loss/total``, ``loss/policy``, ``adv/mean``, ``adv/std``,
        ``kl/ref_k3``, ``kl/ref_k1``, ``entropy/mean``, ``loss/entropy_bonus``, ``tis/*``
        (when inputs given).
    Raises:
        ValueError: shapes, unknown ``loss_agg``, bad ``entropy_coef``, ``tis_cap`` without
            ``generator_logprobs``.
    """
    check_tokens("rloo_loss", mask, logprobs=logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
                 generator_logprobs=generator_logprobs)
    adv = _check_adv("rloo_loss", advantages, mask)
    if entropy_coef < 0 or (entropy_coef > 0 and entropy is None):
        raise ValueError(f"rloo_loss: entropy_coef (algorithm.entropy_coef) must be >= 0 and needs "
                         f"entropy; got {entropy_coef}")
    n_seq, n_tok = resolve_denominators("rloo_loss", mask, global_num_sequences, global_num_tokens)
    weights, pg_mask, tis_metrics = torch.ones_like(mask), mask, {}
    if tis_cap is not None:
        if generator_logprobs is None:
            raise ValueError("rloo_loss: tis_cap (algorithm.tis_cap) is set but generator_logprobs is None")
        weights, pg_mask, tis_metrics = truncated_is_weights(logprobs, generator_logprobs, mask, tis_cap)
    pg = aggregate(-adv[:, None] * weights * logprobs, pg_mask, loss_agg, n_seq, n_tok)
    loss = pg
    metrics = {"loss/policy": pg.detach(), "adv/mean": adv.mean(), "adv/std": adv.std(unbiased=False),
               **tis_metrics}
    loss = _ref_and_entropy_terms(loss, metrics, logprobs, mask, ref_logprobs, entropy, entropy_coef,
                                  loss_agg, n_seq, n_tok)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def proximal_rloo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, *, level: str = "sequence", clip_eps: float = 0.2,
                       clip_eps_high: float | None = None,
                       generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
                       ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                       entropy_coef: float = 0.0, loss_agg: str = "sequence_sum",
                       global_num_sequences: float | None = None,
                       global_num_tokens: float | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Proximal RLOO: RLOO advantage with PPO's clipped ratio pi_theta/pi_old (Noukhovitch et al.
    2024, App. B; see the module docstring for our reading).

    ``level="sequence"`` (one action per completion)::

        rho_i = exp(sum_t m_it (logp_it - logp_old_it))
        w_i   = min(exp(sum_t m_it (logp_old_it - logp_gen_it)), tis_cap)   (1 without tis_cap)
        L     = 1/N sum_i w_i max(-A_i rho_i, -A_i clip(rho_i, 1-eps, 1+eps_high))
              - entropy_coef * agg(H)

    ``level="token"``: the per-token clipped surrogate of ``grpo_loss`` with ``A_i`` on every token
    (aggregated by ``loss_agg``, kl_beta = 0). Gradient flows through ``logprobs`` (and ``entropy``).

    Args:
        logprobs, old_logprobs, mask: ``[B, T]``.
        advantages: ``[B]`` leave-one-out advantages.
        level: ``sequence`` | ``token`` (algorithm.proximal_rloo_level).
        clip_eps, clip_eps_high, generator_logprobs, tis_cap, ref_logprobs, entropy, entropy_coef,
        loss_agg, global_num_sequences, global_num_tokens: see ``grpo_loss`` (``loss_agg`` applies
        to the token level and to the entropy bonus; the sequence level always divides by N).
    Returns:
        ``(loss, metrics)``: ``loss/total``, ``loss/policy``, ``pg/clip_frac`` (fraction of
        sequences, or tokens, whose clipped branch is active), ``pg/ratio_{mean,min,max}``,
        ``pg/approx_kl_old``, ``adv/*``, ``kl/ref_*``, ``tis/*`` (when inputs given).
    Raises:
        ValueError: shapes, unknown ``level``/``loss_agg``, bad coefficients.
    """
    check_tokens("proximal_rloo_loss", mask, logprobs=logprobs, old_logprobs=old_logprobs,
                 generator_logprobs=generator_logprobs, ref_logprobs=ref_logprobs, entropy=entropy)
    adv = _check_adv("proximal_rloo_loss", advantages, mask)
    n_seq, n_tok = resolve_denominators("proximal_rloo_loss", mask, global_num_sequences,
                                        global_num_tokens)
    if level == "token":
        loss, metrics = clipped_policy_loss(
            logprobs, old_logprobs, adv[:, None].expand_as(mask), mask, clip_eps=clip_eps,
            clip_eps_high=clip_eps_high, loss_agg=loss_agg, num_sequences=n_seq, num_tokens=n_tok,
            ref_logprobs=ref_logprobs, kl_beta=0.0, generator_logprobs=generator_logprobs,
            tis_cap=tis_cap, entropy=entropy, entropy_coef=entropy_coef)
    elif level == "sequence":
        loss, metrics = _sequence_clipped(logprobs, old_logprobs, adv, mask, clip_eps, clip_eps_high,
                                          generator_logprobs, tis_cap, ref_logprobs, entropy,
                                          entropy_coef, loss_agg, n_seq, n_tok)
    else:
        raise ValueError("proximal_rloo_loss: level (algorithm.proximal_rloo_level) must be "
                         f"'sequence' or 'token'; got {level!r}")
    metrics["adv/mean"] = adv.mean()
    metrics["adv/std"] = adv.std(unbiased=False)
    return loss, metrics


def _sequence_clipped(logprobs, old_logprobs, adv, mask, clip_eps, clip_eps_high,
                      generator_logprobs, tis_cap, ref_logprobs, entropy, entropy_coef, loss_agg,
                      n_seq, n_tok):
    """Sequence-level clipped surrogate of :func:`proximal_rloo_loss` (shapes as documented there)."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or eps_high <= 0:
        raise ValueError(f"clip_eps / clip_eps_high (algorithm.clip_eps) must be > 0; got "
                         f"{clip_eps}, {eps_high}")
    if entropy_coef < 0 or (entropy_coef > 0 and entropy is None):
        raise ValueError(f"entropy_coef (algorithm.entropy_coef) must be >= 0 and needs entropy; "
                         f"got {entropy_coef}")
    if tis_cap is not None and (generator_logprobs is None or tis_cap <= 0):
        raise ValueError(f"tis_cap (algorithm.tis_cap) must be > 0 and needs generator_logprobs; "
                         f"got {tis_cap}")
    on = mask > 0
    zeros = torch.zeros_like(mask)
    metrics: dict[str, torch.Tensor] = {}
    seq_log_ratio = (torch.where(on, logprobs - old_logprobs.detach(), zeros) * mask).sum(-1)
    ratio = torch.exp(seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_seq = torch.maximum(unclipped, clipped)
    if tis_cap is not None:
        gen = generator_logprobs.detach()
        bad = ((~torch.isfinite(gen)) & on).any(-1)
        log_w = (torch.where(on & torch.isfinite(gen), old_logprobs.detach() - gen, zeros)
                 * mask).sum(-1)
        raw = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))
        w = torch.where(bad, torch.zeros_like(raw), raw.clamp(max=tis_cap))
        per_seq = per_seq * w
        metrics.update({"tis/weight_mean": w.mean(), "tis/capped_frac": (raw > tis_cap).float().mean(),
                        "tis/nonfinite_sequences": bad.float().sum()})
    pg = per_seq.sum() / n_seq
    loss = pg
    metrics["loss/policy"] = pg.detach()
    loss = _ref_and_entropy_terms(loss, metrics, logprobs, mask, ref_logprobs, entropy, entropy_coef,
                                  loss_agg, n_seq, n_tok)
    r = ratio.detach()
    lr = seq_log_ratio.detach()
    metrics.update({"pg/clip_frac": (clipped.detach() > unclipped.detach()).float().mean(),
                    "pg/ratio_mean": r.mean(), "pg/ratio_min": r.min(), "pg/ratio_max": r.max(),
                    "pg/approx_kl_old": ((r - 1.0) - lr).mean(), "loss/total": loss.detach()})
    return loss, metrics


def _ref_and_entropy_terms(loss, metrics, logprobs, mask, ref_logprobs, entropy, entropy_coef,
                           loss_agg, n_seq, n_tok):
    """Shared tail of the RLOO losses: KL-to-reference metrics (k3 and k1) and the optional
    entropy bonus (subtracted from ``loss``). Updates ``metrics`` in place; returns the loss."""
    if ref_logprobs is not None:
        metrics["kl/ref_k3"] = masked_mean(k3_kl(logprobs, ref_logprobs, mask), mask)
        metrics["kl/ref_k1"] = masked_mean(logprobs - ref_logprobs, mask)
    if entropy is not None:
        metrics["entropy/mean"] = masked_mean(entropy, mask)
        if entropy_coef > 0:
            ent = aggregate(entropy, mask, loss_agg, n_seq, n_tok)
            loss = loss - entropy_coef * ent
            metrics["loss/entropy_bonus"] = (-entropy_coef * ent).detach()
    return loss
