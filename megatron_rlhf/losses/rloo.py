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

from megatron_rlhf.losses._common import (_MAX_LOG_RATIO, active_correction, aggregate,
                                          check_tokens, clipped_policy_loss, kl_estimate,
                                          kl_metrics, masked_mean, offpolicy_weights,
                                          resolve_denominators, sequence_offpolicy_weights)

__all__ = ["proximal_rloo_loss", "rloo_loss"]


def _check_adv(fn: str, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if advantages.shape != (mask.shape[0],):
        raise ValueError(f"{fn}: advantages must be [B]={mask.shape[0]}; got {tuple(advantages.shape)}")
    return advantages.detach().to(mask.dtype)


def rloo_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              entropy_coef: float = 0.0, loss_agg: str = "sequence_sum",
              global_num_sequences: float | None = None, global_num_tokens: float | None = None,
              generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
              is_correction: str = "token_tis", is_bounds: tuple[float, float] | None = None,
              kl_beta: float = 0.0, kl_estimator: str = "k3"
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

        L = agg_i,t( -A_i w_it logp_it )  [+ kl_beta * agg_i,t( k(pi_theta || pi_ref)_it )]

    ``is_correction`` picks ``w`` (:func:`~megatron_rlhf.losses._common.offpolicy_weights` with
    pi_theta, detached, as the numerator; ``token_tis`` is the truncation above). The KL term is
    there only with ``algorithm.kl_in_reward: false`` (by default the KL is in the reward,
    ``kl_beta=0`` here). No clipping (use ``proximal_rloo_loss`` for that). Gradient flows through ``logprobs`` (and
    ``entropy``).

    Args:
        logprobs: ``[B, T]`` current-policy token logprobs, with grad.
        advantages: ``[B]`` leave-one-out advantages.
        mask: ``[B, T]`` float completion mask.
        ref_logprobs: ``[B, T]`` or None (``kl/ref_*`` metrics only; the KL belongs in the reward).
        entropy, entropy_coef, loss_agg, global_num_sequences, global_num_tokens: see ``grpo_loss``.
        generator_logprobs: ``[B, T]`` vLLM sampling logprobs (needed with ``tis_cap``; tokens
            whose value is not finite are dropped and counted).
        tis_cap: truncation of the importance weight (algorithm.tis_cap); None with ``token_tis``:
            plain RLOO.
        is_correction, is_bounds: the off-policy correction (algorithm.is_correction,
            algorithm.is_bounds).
        kl_beta, kl_estimator: KL-to-reference term in the loss (needs ``ref_logprobs``).
    Returns:
        ``(loss, metrics)``: ``loss/total``, ``loss/policy``, ``adv/mean``, ``adv/std``,
        ``kl/ref_k{1,2,3}``, ``loss/kl_ref``, ``entropy/mean``, ``loss/entropy_bonus``, ``is/*``,
        ``tis/*`` (when inputs given).
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
    correction = active_correction(is_correction, tis_cap)
    if correction != "none":
        if generator_logprobs is None:
            raise ValueError(f"rloo_loss: algorithm.is_correction={is_correction} (tis_cap={tis_cap}) "
                             "needs generator_logprobs")
        weights, tis_metrics = offpolicy_weights(logprobs, generator_logprobs, mask, correction,
                                                 cap=tis_cap, bounds=is_bounds)
        pg_mask = mask * torch.isfinite(generator_logprobs.detach()).to(mask.dtype)
    pg = aggregate(-adv[:, None] * weights * logprobs, pg_mask, loss_agg, n_seq, n_tok)
    loss = pg
    metrics = {"loss/policy": pg.detach(), "adv/mean": adv.mean(), "adv/std": adv.std(unbiased=False),
               **tis_metrics}
    loss = _ref_and_entropy_terms(loss, metrics, logprobs, mask, ref_logprobs, entropy, entropy_coef,
                                  loss_agg, n_seq, n_tok, kl_beta, kl_estimator)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def proximal_rloo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, *, level: str = "sequence", clip_eps: float = 0.2,
                       clip_eps_high: float | None = None,
                       generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
                       is_correction: str = "token_tis",
                       is_bounds: tuple[float, float] | None = None, kl_beta: float = 0.0,
                       kl_estimator: str = "k3",
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
              [+ kl_beta * agg(k(pi_theta || pi_ref))] - entropy_coef * agg(H)

    ``w_i`` per ``is_correction``
    (:func:`~megatron_rlhf.losses._common.sequence_offpolicy_weights`: ``token_tis`` and
    ``sequence_tis`` give the line above, ``sequence_mask`` adds the geometric-mean filter,
    ``token_mask`` has no sequence form). ``level="token"``: the per-token clipped surrogate of
    ``grpo_loss`` with ``A_i`` on every token (aggregated by ``loss_agg``). The KL term only with
    ``algorithm.kl_in_reward: false`` (by default the KL is in the reward, ``kl_beta=0``). Gradient flows through ``logprobs`` (and ``entropy``).

    Args:
        logprobs, old_logprobs, mask: ``[B, T]``.
        advantages: ``[B]`` leave-one-out advantages.
        level: ``sequence`` | ``token`` (algorithm.proximal_rloo_level).
        clip_eps, clip_eps_high, generator_logprobs, tis_cap, is_correction, is_bounds, kl_beta,
        kl_estimator, ref_logprobs, entropy, entropy_coef, loss_agg, global_num_sequences, global_num_tokens: see ``grpo_loss`` (``loss_agg`` applies
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
            ref_logprobs=ref_logprobs, kl_beta=kl_beta, kl_estimator=kl_estimator,
            generator_logprobs=generator_logprobs, tis_cap=tis_cap, is_correction=is_correction,
            is_bounds=is_bounds, entropy=entropy, entropy_coef=entropy_coef)
    elif level == "sequence":
        loss, metrics = _sequence_clipped(logprobs, old_logprobs, adv, mask, clip_eps, clip_eps_high,
                                          generator_logprobs, tis_cap, ref_logprobs, entropy,
                                          entropy_coef, loss_agg, n_seq, n_tok,
                                          active_correction(is_correction, tis_cap), is_bounds,
                                          kl_beta, kl_estimator)
    else:
        raise ValueError("proximal_rloo_loss: level (algorithm.proximal_rloo_level) must be "
                         f"'sequence' or 'token'; got {level!r}")
    metrics["adv/mean"] = adv.mean()
    metrics["adv/std"] = adv.std(unbiased=False)
    return loss, metrics


def _sequence_clipped(logprobs, old_logprobs, adv, mask, clip_eps, clip_eps_high,
                      generator_logprobs, tis_cap, ref_logprobs, entropy, entropy_coef, loss_agg,
                      n_seq, n_tok, correction, is_bounds, kl_beta, kl_estimator):
    """Sequence-level clipped surrogate of :func:`proximal_rloo_loss` (shapes as documented there)."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or eps_high <= 0:
        raise ValueError(f"clip_eps / clip_eps_high (algorithm.clip_eps) must be > 0; got "
                         f"{clip_eps}, {eps_high}")
    if entropy_coef < 0 or (entropy_coef > 0 and entropy is None):
        raise ValueError(f"entropy_coef (algorithm.entropy_coef) must be >= 0 and needs entropy; "
                         f"got {entropy_coef}")
    if correction != "none" and generator_logprobs is None:
        raise ValueError(f"algorithm.is_correction={correction} needs generator_logprobs")
    on = mask > 0
    zeros = torch.zeros_like(mask)
    metrics: dict[str, torch.Tensor] = {}
    seq_log_ratio = (torch.where(on, logprobs - old_logprobs.detach(), zeros) * mask).sum(-1)
    ratio = torch.exp(seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    per_seq = torch.maximum(unclipped, clipped)
    if correction != "none":
        w, _, w_metrics = sequence_offpolicy_weights(old_logprobs, generator_logprobs, mask, correction,
                                                     cap=tis_cap, bounds=is_bounds)
        per_seq = per_seq * w
        metrics.update(w_metrics)
    pg = per_seq.sum() / n_seq
    loss = pg
    metrics["loss/policy"] = pg.detach()
    loss = _ref_and_entropy_terms(loss, metrics, logprobs, mask, ref_logprobs, entropy, entropy_coef,
                                  loss_agg, n_seq, n_tok, kl_beta, kl_estimator)
    r = ratio.detach()
    lr = seq_log_ratio.detach()
    metrics.update({"pg/clip_frac": (clipped.detach() > unclipped.detach()).float().mean(),
                    "pg/ratio_mean": r.mean(), "pg/ratio_min": r.min(), "pg/ratio_max": r.max(),
                    "pg/approx_kl_old": ((r - 1.0) - lr).mean(), "loss/total": loss.detach()})
    return loss, metrics


def _ref_and_entropy_terms(loss, metrics, logprobs, mask, ref_logprobs, entropy, entropy_coef,
                           loss_agg, n_seq, n_tok, kl_beta=0.0, kl_estimator="k3"):
    """Shared tail of the RLOO losses: KL-to-reference metrics (k1, k2, k3), the KL term
    ``kl_beta * agg(k)`` when ``kl_beta > 0`` (algorithm.kl_in_reward: false) and the optional
    entropy bonus (subtracted from ``loss``). Updates ``metrics`` in place; returns the loss."""
    if kl_beta < 0 or (kl_beta > 0 and ref_logprobs is None):
        raise ValueError(f"kl_beta (algorithm.kl_beta) must be >= 0 and needs ref_logprobs; got {kl_beta}")
    if ref_logprobs is not None:
        metrics.update(kl_metrics(logprobs, ref_logprobs, mask))
        if kl_beta > 0:
            kl_loss = aggregate(kl_estimate(logprobs, ref_logprobs, mask, kl_estimator), mask, loss_agg,
                                n_seq, n_tok)
            loss = loss + kl_beta * kl_loss
            metrics["loss/kl_ref"] = kl_loss.detach()
    if entropy is not None:
        metrics["entropy/mean"] = masked_mean(entropy, mask)
        if entropy_coef > 0:
            ent = aggregate(entropy, mask, loss_agg, n_seq, n_tok)
            loss = loss - entropy_coef * ent
            metrics["loss/entropy_bonus"] = (-entropy_coef * ent).detach()
    return loss
