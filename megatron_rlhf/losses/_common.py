"""Shared pieces of the policy-gradient losses: input checks, masked aggregation with explicit
denominators, the clipped surrogate, the k3 KL estimator and truncated importance sampling.

Conventions (all losses): token tensors are ``[B, T]`` (``B`` sequences, ``T`` positions); position
``t`` of a logprob tensor holds ``log p(x_t | x_<t)`` in nats; ``mask`` is a float ``[B, T]`` tensor,
1.0 on completion tokens and 0.0 on prompt and padding. Values at masked-out positions are never
read (they may be ``nan``/``-inf``): every use goes through ``torch.where(mask > 0, x, 0)``.
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATIONS", "aggregate", "check_tokens", "clipped_policy_loss", "k3_kl",
           "masked_mean", "resolve_denominators", "truncated_is_weights"]

AGGREGATIONS = ("sequence_sum", "sequence_token_mean", "token_mean")
"""How a per-token loss becomes a scalar (see :func:`aggregate`)."""

_MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` so one diverged token cannot produce inf/nan."""


def check_tokens(fn: str, mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless ``mask`` is ``[B, T]`` floating and every given tensor has its shape.

    Args:
        fn: the calling loss's name, used in the message.
        mask: ``[B, T]`` float completion mask.
        **tensors: named ``[B, T]`` tensors (``None`` entries are skipped).
    Raises:
        ValueError: ``mask`` is not 2-D floating, or a tensor's shape differs from ``mask``'s.
    """
    if mask.dim() != 2 or not mask.is_floating_point():
        raise ValueError(f"{fn}: mask must be a float tensor [B, T]; got dtype {mask.dtype}, "
                         f"shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{fn}: {name} must have the mask's shape {tuple(mask.shape)} "
                             f"[B, T]; got {tuple(t.shape)}")


def resolve_denominators(fn: str, mask: torch.Tensor, global_num_sequences: float | None,
                         global_num_tokens: float | None) -> tuple[float, float]:
    """The sequence and token denominators: the given global counts, else the local ones.

    Pass the counts of the WHOLE batch (all micro-batches, all data-parallel ranks) so that the sum of
    the micro-batch losses equals the loss of the whole batch (torchtitan's ``global_valid_tokens``,
    NeMo-RL's ``global_valid_seqs/toks``).

    Args:
        fn: caller name for messages.
        mask: ``[B, T]`` float completion mask of this micro-batch.
        global_num_sequences: sequences in the whole batch, or ``None`` for ``B``.
        global_num_tokens: masked tokens in the whole batch, or ``None`` for ``mask.sum()``.
    Returns:
        ``(num_sequences, num_tokens)`` as Python floats.
    Raises:
        ValueError: a denominator is ``<= 0`` (e.g. a batch without completion tokens).
    """
    n_seq = float(mask.shape[0]) if global_num_sequences is None else float(global_num_sequences)
    n_tok = float(mask.sum().item()) if global_num_tokens is None else float(global_num_tokens)
    if n_seq <= 0:
        raise ValueError(f"{fn}: global_num_sequences must be > 0; got {n_seq}")
    if n_tok <= 0:
        raise ValueError(f"{fn}: the batch has no completion tokens (global_num_tokens={n_tok}); "
                         "check loss_mask / global_num_tokens")
    return n_seq, n_tok


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_sequences: float,
              num_tokens: float) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar with an explicit denominator.

    Modes (``x`` the per-token loss, ``m`` the mask, ``n_i = sum_t m_it``)::

        sequence_sum        sum_i sum_t m x / N                 (no length normalisation; Dr. GRPO,
                                                                 Liu et al. 2025, sec. 3.1)
        sequence_token_mean sum_i (sum_t m x / n_i) / N         (per-sequence token mean; GRPO as
                                                                 written by Shao et al. 2024, eq. 3)
        token_mean          sum_i sum_t m x / N_tok             (DAPO, Yu et al. 2025, eq. 8; TRL PPO)

    Every mode is a sum over sequences divided by a constant, so summing it over micro-batches with the
    global ``N``/``N_tok`` gives the whole-batch value.

    Args:
        per_token: ``[B, T]`` loss per token (masked positions ignored).
        mask: ``[B, T]`` float mask.
        mode: one of :data:`AGGREGATIONS`.
        num_sequences: ``N`` (whole-batch sequence count).
        num_tokens: ``N_tok`` (whole-batch masked-token count).
    Returns:
        Scalar tensor.
    Raises:
        ValueError: unknown ``mode``.
    """
    x = torch.where(mask > 0, per_token, torch.zeros_like(per_token)) * mask
    if mode == "sequence_sum":
        return x.sum() / num_sequences
    if mode == "sequence_token_mean":
        return (x.sum(-1) / mask.sum(-1).clamp_min(1.0)).sum() / num_sequences
    if mode == "token_mean":
        return x.sum() / num_tokens
    raise ValueError(f"loss aggregation (algorithm.loss_agg) must be one of {AGGREGATIONS}; "
                     f"got {mode!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask > 0`` (0 when the mask is empty); detached.

    Args:
        x: ``[B, T]`` (or any shape equal to ``mask``'s).
        mask: float mask of the same shape.
    Returns:
        Detached scalar.
    """
    x = torch.where(mask > 0, x.detach(), torch.zeros_like(x))
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Unbiased and non-negative for samples from pi_theta (Schulman 2020, "Approximating KL
    divergence", k3; used by Shao et al. 2024, eq. 4). Gradient flows through ``logprobs`` only.

    Args:
        logprobs: ``[B, T]`` current-policy token logprobs (nats).
        ref_logprobs: ``[B, T]`` reference token logprobs (detached here).
        mask: ``[B, T]`` float mask; masked-out positions return 0.
    Returns:
        ``[B, T]`` per-token KL estimate (nats), 0 outside the mask.
    """
    d = torch.where(mask > 0, ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))
    d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def truncated_is_weights(old_logprobs: torch.Tensor, generator_logprobs: torch.Tensor,
                         mask: torch.Tensor, cap: float
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights of the learner's pi_old against the generator's sampler.

    ``w_t = min(exp(logp_old_t - logp_gen_t), cap)``, detached: the tokens were sampled by the
    generator (vLLM, after temperature), not by pi_old, so the pi_old-based objective is reweighted
    (Espeholt et al. 2018, IMPALA, eq. 1 truncated rho; "TIS", Yao et al. 2025, Feng et al.'s
    "Your efficient RL framework secretly brings you off-policy RL training"). Tokens whose generator
    logprob is not finite are dropped (returned in a reduced mask) and counted, never crash.

    Args:
        old_logprobs: ``[B, T]`` pi_old token logprobs (learner recompute before the first update).
        generator_logprobs: ``[B, T]`` sampling logprobs reported by the generator.
        mask: ``[B, T]`` float mask.
        cap: truncation ``> 0`` (e.g. 2.0).
    Returns:
        ``(weights [B, T], mask [B, T], metrics)``: weights detached, 0 outside the returned mask;
        metrics ``tis/weight_mean``, ``tis/capped_frac``, ``tis/nonfinite_tokens``.
    Raises:
        ValueError: ``cap <= 0``.
    """
    if cap <= 0:
        raise ValueError(f"truncated importance sampling: cap (algorithm.tis_cap) must be > 0; got {cap}")
    gen = generator_logprobs.detach()
    finite = torch.isfinite(gen) & (mask > 0)
    nonfinite = ((mask > 0) & ~finite).sum()
    keep = mask * finite.to(mask.dtype)
    log_w = torch.where(finite, old_logprobs.detach() - gen, torch.zeros_like(gen))
    raw = torch.exp(log_w.clamp(max=_MAX_LOG_RATIO))
    w = torch.where(keep > 0, raw.clamp(max=cap), torch.zeros_like(raw))
    metrics = {"tis/weight_mean": masked_mean(w, keep),
               "tis/capped_frac": masked_mean((raw > cap).to(mask.dtype), keep),
               "tis/nonfinite_tokens": nonfinite.detach().to(mask.dtype)}
    return w, keep, metrics


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, clip_eps: float, clip_eps_high: float | None,
                        loss_agg: str, num_sequences: float, num_tokens: float,
                        ref_logprobs: torch.Tensor | None = None, kl_beta: float = 0.0,
                        generator_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
                        entropy: torch.Tensor | None = None, entropy_coef: float = 0.0
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate + optional k3 KL penalty + entropy bonus (shared core).

    Per token (Schulman et al. 2017, eq. 7; Shao et al. 2024, eq. 3)::

        r_t   = exp(logp_t - logp_old_t)
        pg_t  = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps_high))
        kl_t  = k3(logp_t, logp_ref_t)
        loss  = agg(pg) + kl_beta * agg(kl) - entropy_coef * agg(entropy)

    ``w_t`` the truncated IS weight (:func:`truncated_is_weights`; 1 when ``tis_cap`` is None).
    Gradient flows through ``logprobs`` (and ``entropy``) only; all other inputs are detached.

    Args:
        logprobs, old_logprobs, mask: ``[B, T]``.
        advantages: ``[B, T]`` (already broadcast from ``[B]`` for sequence-level advantages).
        clip_eps: lower clip ``eps`` (> 0); ``clip_eps_high`` upper (``None`` = ``clip_eps``).
        loss_agg, num_sequences, num_tokens: see :func:`aggregate`.
        ref_logprobs: ``[B, T]`` or None (then ``kl_beta`` must be 0; KL metrics skipped).
        kl_beta: KL coefficient (>= 0).
        generator_logprobs, tis_cap: both given to enable TIS (generator_logprobs alone only logs
            the gap).
        entropy: ``[B, T]`` per-token entropy of the current policy (nats) or None.
        entropy_coef: bonus coefficient (>= 0); needs ``entropy`` when > 0.
    Returns:
        ``(loss, metrics)`` (metrics detached scalars, means over this micro-batch's masked tokens).
    Raises:
        ValueError: invalid coefficients or a missing input the options need.
    """
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if eps_low <= 0 or eps_high <= 0:
        raise ValueError(f"clip_eps / clip_eps_high (algorithm.clip_eps) must be > 0; got "
                         f"{eps_low}, {eps_high}")
    if kl_beta < 0 or (kl_beta > 0 and ref_logprobs is None):
        raise ValueError(f"kl_beta (algorithm.kl_beta) must be >= 0 and needs ref_logprobs; got "
                         f"{kl_beta}, ref_logprobs={'given' if ref_logprobs is not None else None}")
    if entropy_coef < 0 or (entropy_coef > 0 and entropy is None):
        raise ValueError(f"entropy_coef (algorithm.entropy_coef) must be >= 0 and needs entropy; "
                         f"got {entropy_coef}")
    if tis_cap is not None and generator_logprobs is None:
        raise ValueError("tis_cap (algorithm.tis_cap) is set but generator_logprobs is None")

    metrics: dict[str, torch.Tensor] = {}
    pg_mask = mask
    weights = torch.ones_like(mask)
    if generator_logprobs is not None:
        gen_ok = torch.isfinite(generator_logprobs.detach()) & (mask > 0)
        gap = torch.where(gen_ok, (old_logprobs.detach() - generator_logprobs.detach()).abs(),
                          torch.zeros_like(mask))
        metrics["logprobs/gen_gap_abs_mean"] = masked_mean(gap, mask * gen_ok.to(mask.dtype))
        if tis_cap is not None:
            weights, pg_mask, tis_metrics = truncated_is_weights(old_logprobs, generator_logprobs,
                                                                 mask, tis_cap)
            metrics.update(tis_metrics)

    adv = advantages.detach()
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_token = torch.maximum(unclipped, clipped) * weights
    pg_loss = aggregate(pg_token, pg_mask, loss_agg, num_sequences, num_tokens)
    loss = pg_loss
    metrics["loss/policy"] = pg_loss.detach()

    if ref_logprobs is not None:
        kl_tok = k3_kl(logprobs, ref_logprobs, mask)
        metrics["kl/ref_k3"] = masked_mean(kl_tok, mask)
        metrics["kl/ref_k1"] = masked_mean(logprobs - ref_logprobs, mask)
        if kl_beta > 0:
            kl_loss = aggregate(kl_tok, mask, loss_agg, num_sequences, num_tokens)
            loss = loss + kl_beta * kl_loss
            metrics["loss/kl_ref"] = kl_loss.detach()
    if entropy is not None:
        metrics["entropy/mean"] = masked_mean(entropy, mask)
        if entropy_coef > 0:
            ent = aggregate(entropy, mask, loss_agg, num_sequences, num_tokens)
            loss = loss - entropy_coef * ent
            metrics["loss/entropy_bonus"] = (-entropy_coef * ent).detach()

    r = ratio.detach()
    on = mask > 0
    # clip fraction: tokens whose gradient the clip removes (the clipped branch is strictly larger).
    metrics["pg/clip_frac"] = masked_mean((clipped.detach() > unclipped.detach()).to(mask.dtype), mask)
    metrics["pg/ratio_outside_frac"] = masked_mean(
        ((r < 1.0 - eps_low) | (r > 1.0 + eps_high)).to(mask.dtype), mask)
    metrics["pg/ratio_mean"] = masked_mean(r, mask)
    metrics["pg/ratio_max"] = r[on].max() if on.any() else r.new_tensor(1.0)
    metrics["pg/ratio_min"] = r[on].min() if on.any() else r.new_tensor(1.0)
    # approx KL(pi_old || pi_theta) via k3 on the old samples (Schulman 2020).
    metrics["pg/approx_kl_old"] = masked_mean((r - 1.0) - log_ratio.detach(), mask)
    metrics["loss/total"] = loss.detach()
    return loss, metrics
