"""Shared pieces of the policy-gradient losses: input checks, masked aggregation with explicit
denominators, the clipped surrogate, the k3 KL estimator and truncated importance sampling.

Conventions (all losses): token tensors are ``[B, T]`` (``B`` sequences, ``T`` positions); position
``t`` of a logprob tensor holds ``log p(x_t | x_<t)`` in nats; ``mask`` is a float ``[B, T]`` tensor,
1.0 on completion tokens and 0.0 on prompt and padding. Values at masked-out positions are never
read (they may be ``nan``/``-inf``): every use goes through ``torch.where(mask > 0, x, 0)``.
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATIONS", "IS_CORRECTIONS", "KL_ESTIMATORS", "aggregate", "check_tokens",
           "active_correction", "clipped_policy_loss", "effective_sample_size", "k3_kl",
           "kl_estimate", "kl_metrics", "masked_mean",
           "offpolicy_weights", "resolve_denominators", "sequence_offpolicy_weights",
           "truncated_is_weights"]

IS_CORRECTIONS = ("none", "token_tis", "token_mask", "sequence_tis", "sequence_mask")
"""Off-policy corrections of the policy-gradient losses (``algorithm.is_correction``; see
:func:`offpolicy_weights`)."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Per-token estimators of KL(pi || pi_ref) (``algorithm.kl_estimator``; see :func:`kl_estimate`)."""

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


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs (Schulman 2020,
    "Approximating KL divergence"), with ``r = log pi - log pi_ref``::

        k1 = r                       unbiased, high variance, negative on some tokens
        k2 = r^2 / 2                 biased (its gradient is KL's), low variance, >= 0
        k3 = exp(-r) - 1 + r         unbiased, low variance, >= 0 (Shao et al. 2024, eq. 4)

    The same definitions as verl's ``kl_penalty`` (``verl/trainer/ppo/core_algos.py``: ``k1``/"kl",
    ``k2``/"mse", ``k3``/"low_var_kl") and NeMo-RL's ``calculate_kl``
    (``nemo_rl/algorithms/utils.py``). ``r`` is clamped to +-20 before ``exp`` (k3). Gradient
    flows through ``logprobs`` only.

    Args:
        logprobs: ``[B, T]`` policy token logprobs (nats): the current policy's for a loss term,
            pi_old's for a reward penalty.
        ref_logprobs: ``[B, T]`` reference token logprobs (detached here).
        mask: ``[B, T]`` float mask; masked-out positions return 0.
        estimator: ``k1`` | ``k2`` | ``k3`` (algorithm.kl_estimator).
    Returns:
        ``[B, T]`` per-token estimate (nats), 0 outside the mask.
    Raises:
        ValueError: unknown ``estimator``.
    """
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs, mask)
    r = torch.where(mask > 0, logprobs - ref_logprobs.detach(), torch.zeros_like(logprobs))
    if estimator == "k1":
        return r
    if estimator == "k2":
        return 0.5 * r * r
    raise ValueError(f"KL estimator (algorithm.kl_estimator) must be one of {KL_ESTIMATORS}; "
                     f"got {estimator!r}")


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size of importance weights: ``(sum w)^2 / (n sum w^2)`` in
    ``(0, 1]`` over the ``n`` positions where ``mask > 0`` (Kish 1965; verl's
    ``rollout_is_eff_sample_size`` = ``1 / E[(w / E[w])^2]``, the same quantity,
    ``verl/trainer/ppo/rollout_corr_helper.py``). 1 when every weight is equal; ``1/n`` when one
    weight carries everything; 0 when every weight is 0 (all masked). Detached.

    Args:
        weights: any shape; mask: float, same shape.
    Returns:
        Detached scalar.
    """
    on = mask > 0
    w = torch.where(on, weights.detach().double(), torch.zeros_like(weights, dtype=torch.float64))
    n = on.sum().double()
    sq = (w * w).sum()
    if n == 0 or sq == 0:
        return weights.new_zeros(())
    return ((w.sum() ** 2) / (n * sq)).to(weights.dtype)


def _finite_log_ratio(numerator: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor):
    """``(log ratio [B, T] (0 where dropped), finite-and-masked [B, T] bool)`` of a detached
    ``numerator`` against the generator's logprobs; tokens with a non-finite generator logprob drop."""
    gen = generator_logprobs.detach()
    finite = torch.isfinite(gen) & (mask > 0)
    log_w = torch.where(finite, numerator.detach() - gen, torch.zeros_like(gen))
    return log_w, finite


def offpolicy_weights(numerator: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor,
                      correction: str, *, cap: float | None, bounds: tuple[float, float] | None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights of a token-level policy-gradient loss against the generator's
    sampling distribution, for ``algorithm.is_correction``.

    With ``rho_t = exp(logp_num_t - logp_gen_t)`` (``numerator``: pi_old, or pi_theta detached for
    plain rloo; clamped at exp(20)) and ``[lo, hi]`` = ``bounds``::

        none           w_t = 1
        token_tis      w_t = min(rho_t, cap)                 truncated IS (IMPALA, Espeholt et al.
                                                            2018 eq. 1; Yao et al. 2025 "TIS";
                                                            NeMo-RL "tis"; verl rollout_is=token)
        token_mask     w_t = rho_t if lo <= rho_t <= hi      masked IS, "icepop" / MIS (NeMo-RL
                       else 0                               "icepop"; verl rollout_rs=token)
        sequence_tis   w_it = min(prod_t rho_it, cap)        sequence-level truncated IS (verl
                                                            rollout_is=sequence)
        sequence_mask  w_it = rho_it if lo <= g_i <= hi      seq-mask-tis: sequences whose geometric
                       else 0, g_i = exp(mean_t log rho_it) mean ratio leaves the bounds are
                                                            dropped, the others keep untruncated
                                                            token weights (NeMo-RL "seq-mask-tis";
                                                            verl rollout_rs=geometric)

    Anchors: NeMo-RL ``ClippedPGLossFn`` (``nemo_rl/algorithms/loss_functions.py``,
    ``truncated_importance_sampling_type``), verl ``compute_rollout_correction_weights`` /
    ``compute_rollout_rejection_mask`` (``verl/trainer/ppo/rollout_corr_helper.py``). As in
    NeMo-RL, a masked token (or sequence) gets weight 0 and the loss's denominators are unchanged
    (the whole batch's counts), so the loss stays additive over micro-batches. A token whose
    generator logprob is not finite gets weight 0 under every correction but ``none`` (a sequence
    holding one, under the sequence corrections). All weights are detached.

    Args:
        numerator: ``[B, T]`` logprobs of the policy the objective is built on.
        generator_logprobs: ``[B, T]`` sampling logprobs reported by the generator.
        mask: ``[B, T]`` float completion mask.
        correction: one of :data:`IS_CORRECTIONS`.
        cap: truncation (algorithm.tis_cap) for ``token_tis`` / ``sequence_tis``.
        bounds: ``(lo, hi)`` (algorithm.is_bounds) for ``token_mask`` / ``sequence_mask``.
    Returns:
        ``(weights [B, T], metrics)``: weights 0 outside ``mask``; metrics ``is/masked_frac``
        (completion tokens whose weight the correction set to 0), ``is/weight_mean`` and
        ``is/weight_max`` (over the completion tokens it kept), ``is/ess``
        (:func:`effective_sample_size` of the weights the loss uses: over sequences for
        ``sequence_tis``, over completion tokens otherwise), ``is/nonfinite_tokens``;
        ``token_tis`` adds today's ``tis/weight_mean``, ``tis/capped_frac``,
        ``tis/nonfinite_tokens``. ``none``: no metrics.
    Raises:
        ValueError: unknown ``correction``, or the cap / bounds it needs missing or invalid.
    """
    if correction == "none":
        return torch.ones_like(mask) * mask, {}
    if correction == "token_tis":
        w, keep, tis = truncated_is_weights(numerator, generator_logprobs, mask, _need_cap(correction, cap))
        return w, {**_is_metrics(w, mask, keep > 0, w, mask),
                   "is/nonfinite_tokens": tis["tis/nonfinite_tokens"], **tis}
    log_w, finite = _finite_log_ratio(numerator, generator_logprobs, mask)
    nonfinite = ((mask > 0) & ~finite).sum().to(mask.dtype)
    rho = torch.exp(log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if correction == "token_mask":
        lo, hi = _need_bounds(correction, bounds)
        keep = finite & (rho >= lo) & (rho <= hi)
        w = torch.where(keep, rho, torch.zeros_like(rho))
        return w, {**_is_metrics(w, mask, keep, w, mask), "is/nonfinite_tokens": nonfinite}
    rows = (mask.sum(-1) > 0).to(mask.dtype)
    if correction == "sequence_tis":
        seq_w, seq_keep, _ = sequence_offpolicy_weights(numerator, generator_logprobs, mask, correction,
                                                        cap=cap, bounds=None)
        w = seq_w[:, None].expand_as(mask) * mask
        metrics = _is_metrics(w, mask, seq_keep[:, None] & (mask > 0), seq_w, rows)
    elif correction == "sequence_mask":   # kept sequences keep their untruncated token weights
        lo, hi = _need_bounds(correction, bounds)
        bad = ((mask > 0) & ~finite).any(-1)
        geo = torch.exp(((log_w * mask).sum(-1) / mask.sum(-1).clamp_min(1.0))
                        .clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        seq_keep = ~bad & (geo >= lo) & (geo <= hi)
        w = torch.where(seq_keep[:, None] & finite, rho, torch.zeros_like(rho)) * mask
        metrics = _is_metrics(w, mask, seq_keep[:, None] & (mask > 0), w, mask)
    else:
        raise ValueError(f"off-policy correction (algorithm.is_correction) must be one of "
                         f"{IS_CORRECTIONS}; got {correction!r}")
    metrics["is/nonfinite_tokens"] = nonfinite
    return w, metrics


def sequence_offpolicy_weights(numerator: torch.Tensor, generator_logprobs: torch.Tensor,
                               mask: torch.Tensor, correction: str, *, cap: float | None,
                               bounds: tuple[float, float] | None
                               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One importance weight per sequence (the sequence corrections of :func:`offpolicy_weights`;
    the sequence-level proximal RLOO uses it directly).

    ``S_i = sum_t m_it (logp_num_it - logp_gen_it)``, ``n_i`` the row's completion tokens::

        sequence_tis  (and token_tis on a sequence-level loss: today's behaviour)
                      w_i = min(exp(S_i), cap)                   (verl rollout_is=sequence)
        sequence_mask w_i = min(exp(S_i), cap) if lo <= exp(S_i / n_i) <= hi else 0
                      (seq-mask-tis's geometric-mean filter, NeMo-RL; on a sequence-level loss the
                      token weights of a kept sequence multiply to exp(S_i), truncated at the cap)
        none          w_i = 1

    A sequence with a non-finite generator logprob on a completion token gets ``w_i = 0``.

    Args:
        numerator, generator_logprobs, mask: ``[B, T]`` (see :func:`offpolicy_weights`).
        correction: ``none`` | ``token_tis`` | ``sequence_tis`` | ``sequence_mask``.
        cap, bounds: as in :func:`offpolicy_weights` (sequence_mask needs both).
    Returns:
        ``(weights [B], kept [B] bool, metrics)``: metrics ``is/*`` over sequences (the masked
        fraction over completion tokens) and ``tis/weight_mean``, ``tis/capped_frac``,
        ``tis/nonfinite_sequences`` (the sequence-level metrics of today).
    Raises:
        ValueError: unknown ``correction`` (``token_mask`` has no sequence-level form), or a
            missing / invalid cap or bounds.
    """
    rows = (mask.sum(-1) > 0)
    if correction == "none":
        return torch.ones_like(mask[:, 0]), rows, {}
    if correction not in ("token_tis", "sequence_tis", "sequence_mask"):
        raise ValueError(f"algorithm.is_correction={correction!r} has no sequence-level form; use "
                         "none, token_tis, sequence_tis or sequence_mask with a sequence-level loss")
    cap = _need_cap(correction, cap)
    log_w, finite = _finite_log_ratio(numerator, generator_logprobs, mask)
    bad = ((mask > 0) & ~finite).any(-1)
    s = (log_w * mask).sum(-1)
    raw = torch.exp(s.clamp(max=_MAX_LOG_RATIO))
    keep = rows & ~bad
    if correction == "sequence_mask":
        lo, hi = _need_bounds(correction, bounds)
        geo = torch.exp((s / mask.sum(-1).clamp_min(1.0)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        keep = keep & (geo >= lo) & (geo <= hi)
    w = torch.where(keep, raw.clamp(max=cap), torch.zeros_like(raw))
    row_f = rows.to(mask.dtype)
    metrics = _is_metrics(w[:, None].expand_as(mask), mask, keep[:, None] & (mask > 0), w, row_f)
    metrics.update({"tis/weight_mean": masked_mean(w, row_f),
                    "tis/capped_frac": masked_mean((raw > cap).to(mask.dtype), row_f),
                    "tis/nonfinite_sequences": bad.to(mask.dtype).sum()})
    return w, keep, metrics


def _is_metrics(w_tok: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, w_ess: torch.Tensor,
                ess_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``is/masked_frac``, ``is/weight_mean``, ``is/weight_max`` over completion tokens (``keep``:
    the ones a correction kept) and ``is/ess`` of ``w_ess`` over ``ess_mask``."""
    on = mask > 0
    kept = keep & on
    wk = w_tok.detach()
    return {"is/masked_frac": masked_mean((on & ~kept).to(mask.dtype), mask),
            "is/weight_mean": masked_mean(wk, kept.to(mask.dtype)),
            "is/weight_max": wk[kept].max() if kept.any() else mask.new_zeros(()),
            "is/ess": effective_sample_size(w_ess, ess_mask)}


def _need_cap(correction: str, cap: float | None) -> float:
    if cap is None or cap <= 0:
        raise ValueError(f"algorithm.is_correction={correction} needs algorithm.tis_cap > 0; got {cap}")
    return float(cap)


def _need_bounds(correction: str, bounds) -> tuple[float, float]:
    if bounds is None or len(bounds) != 2 or not (0 <= bounds[0] < bounds[1]):
        raise ValueError(f"algorithm.is_correction={correction} needs algorithm.is_bounds = [lo, hi] "
                         f"with 0 <= lo < hi; got {bounds}")
    return float(bounds[0]), float(bounds[1])


def active_correction(is_correction: str, tis_cap: float | None) -> str:
    """The correction that runs: ``token_tis`` with ``tis_cap`` None is ``none`` (the older way to
    turn TIS off); every other value as given.

    Raises:
        ValueError: unknown ``is_correction``.
    """
    if is_correction not in IS_CORRECTIONS:
        raise ValueError(f"off-policy correction (algorithm.is_correction) must be one of "
                         f"{IS_CORRECTIONS}; got {is_correction!r}")
    return "none" if is_correction == "token_tis" and tis_cap is None else is_correction


def kl_metrics(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """``kl/ref_k1``, ``kl/ref_k2``, ``kl/ref_k3``: the three estimators' means over the masked
    tokens (:func:`kl_estimate`), detached."""
    return {f"kl/ref_{k}": masked_mean(kl_estimate(logprobs.detach(), ref_logprobs, mask, k), mask)
            for k in KL_ESTIMATORS}


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
                        is_correction: str = "token_tis",
                        is_bounds: tuple[float, float] | None = None, kl_estimator: str = "k3",
                        entropy: torch.Tensor | None = None, entropy_coef: float = 0.0
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate + optional KL penalty + entropy bonus (shared core).

    Per token (Schulman et al. 2017, eq. 7; Shao et al. 2024, eq. 3)::

        r_t   = exp(logp_t - logp_old_t)
        pg_t  = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps_high))
        kl_t  = k(logp_t, logp_ref_t)          k = kl_estimator (:func:`kl_estimate`; default k3)
        loss  = agg(pg) + kl_beta * agg(kl) - entropy_coef * agg(entropy)

    ``w_t`` the off-policy weight of pi_old against the generator (:func:`offpolicy_weights` for
    ``is_correction``; ``token_tis`` with ``tis_cap`` None, or ``none``: 1). Gradient flows
    through ``logprobs`` (and ``entropy``) only; all other inputs are detached.

    Args:
        logprobs, old_logprobs, mask: ``[B, T]``.
        advantages: ``[B, T]`` (already broadcast from ``[B]`` for sequence-level advantages).
        clip_eps: lower clip ``eps`` (> 0); ``clip_eps_high`` upper (``None`` = ``clip_eps``).
        loss_agg, num_sequences, num_tokens: see :func:`aggregate`.
        ref_logprobs: ``[B, T]`` or None (then ``kl_beta`` must be 0; KL metrics skipped).
        kl_beta: KL coefficient (>= 0).
        generator_logprobs: ``[B, T]`` sampling logprobs (alone: only the gap metric).
        tis_cap: truncation of ``token_tis`` / ``sequence_tis`` (None with ``token_tis``: off).
        is_correction: one of :data:`IS_CORRECTIONS` (algorithm.is_correction).
        is_bounds: ``(lo, hi)`` of ``token_mask`` / ``sequence_mask`` (algorithm.is_bounds).
        kl_estimator: ``k1`` | ``k2`` | ``k3`` of the KL term (algorithm.kl_estimator).
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
    correction = active_correction(is_correction, tis_cap)
    if correction != "none" and generator_logprobs is None:
        raise ValueError(f"algorithm.is_correction={is_correction} (tis_cap={tis_cap}) needs "
                         "generator_logprobs")

    metrics: dict[str, torch.Tensor] = {}
    pg_mask = mask
    weights = torch.ones_like(mask)
    if generator_logprobs is not None:
        gen_ok = torch.isfinite(generator_logprobs.detach()) & (mask > 0)
        gap = torch.where(gen_ok, (old_logprobs.detach() - generator_logprobs.detach()).abs(),
                          torch.zeros_like(mask))
        metrics["logprobs/gen_gap_abs_mean"] = masked_mean(gap, mask * gen_ok.to(mask.dtype))
        if correction != "none":
            weights, is_metrics = offpolicy_weights(old_logprobs, generator_logprobs, mask, correction,
                                                    cap=tis_cap, bounds=is_bounds)
            pg_mask = mask * gen_ok.to(mask.dtype)   # non-finite tokens leave the sequence means too
            metrics.update(is_metrics)

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
        kl_tok = kl_estimate(logprobs, ref_logprobs, mask, kl_estimator)
        metrics.update(kl_metrics(logprobs, ref_logprobs, mask))
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
