"""Batch-level transforms of rewards into advantages (computed ONCE per batch, before micro-batching).

Group layout: rewards come either as ``[G, K]`` (G prompts x K samples; row-major flattening gives
the ``B = G*K`` sequence order) or as ``[B]`` together with integer ``group_ids [B]`` (any labels,
groups may differ in size). Each transform returns the same shape as its ``rewards`` input.
"""

from __future__ import annotations

import torch

from megatron_rlhf.losses._common import check_tokens, kl_estimate

__all__ = ["best_of_k_mask", "gae", "group_dpo_pairs", "group_relative_advantages",
           "kl_penalized_rewards", "leave_one_out_advantages", "masked_whiten",
           "ppo_advantages", "ppo_token_rewards"]


def _groups(fn: str, rewards: torch.Tensor, group_ids: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten rewards and index groups: ``(flat [B] float, inverse [B] long in [0, G), counts [G])``."""
    if rewards.dim() == 2:
        if group_ids is not None:
            raise ValueError(f"{fn}: pass either rewards [G, K] or rewards [B] with group_ids [B], "
                             "not both")
        g, k = rewards.shape
        inverse = torch.arange(g, device=rewards.device).repeat_interleave(k)
        return rewards.reshape(-1).float(), inverse, torch.full((g,), k, device=rewards.device)
    if rewards.dim() != 1 or group_ids is None or group_ids.shape != rewards.shape:
        raise ValueError(f"{fn}: rewards must be [G, K], or [B] with group_ids [B]; got rewards "
                         f"{tuple(rewards.shape)}, group_ids "
                         f"{None if group_ids is None else tuple(group_ids.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return rewards.float(), inverse, counts


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_relative_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None, *,
                              normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages: ``(r_i - mean_g) / (std_g + eps)`` within each prompt group.

    Shao et al. 2024 (DeepSeekMath), sec. 4.1.2 ("outcome supervision"); Lanchantin et al. 2025,
    eq. 1. ``std_g`` is the population standard deviation (divide by K, so K=1 gives advantage 0
    instead of nan). ``normalize_std=False`` drops the division (Liu et al. 2025, Dr. GRPO, sec. 3.1).

    Args:
        rewards: ``[G, K]`` or ``[B]`` (with ``group_ids``), scalar rewards per sequence.
        group_ids: ``[B]`` integer prompt ids, or None for ``[G, K]`` rewards.
        normalize_std: divide by the group std (algorithm.grpo_normalize_std).
        eps: added to the std (unitless).
    Returns:
        Advantages, same shape as ``rewards``, float, no grad.
    Raises:
        ValueError: bad shapes (see module docstring).
    """
    flat, inv, counts = _groups("group_relative_advantages", rewards, group_ids)
    flat = flat.detach()
    n = counts.to(flat.dtype)
    mean = _group_sum(flat, inv, len(counts)) / n
    centered = flat - mean[inv]
    if normalize_std:
        std = torch.sqrt(_group_sum(centered ** 2, inv, len(counts)) / n)
        centered = centered / (std[inv] + eps)
    return centered.reshape(rewards.shape)


def leave_one_out_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """RLOO advantages: ``A_i = r_i - mean_{j != i, same group} r_j``.

    Ahmadian et al. 2024 ("Back to Basics"), sec. 3.3 eq. 6 (REINFORCE Leave-One-Out, after
    Kool et al. 2019); Noukhovitch et al. 2024, sec. 2 (RLOO). Computed as
    ``A_i = r_i - (S_g - r_i) / (n_g - 1)`` with ``S_g`` the group's reward sum.

    Args:
        rewards: ``[G, K]`` or ``[B]`` (with ``group_ids``); rewards may already include a
            sequence-level KL penalty (:func:`kl_penalized_rewards`).
        group_ids: ``[B]`` integer prompt ids or None.
    Returns:
        Advantages, same shape as ``rewards``, no grad.
    Raises:
        ValueError: a group has fewer than 2 samples (the leave-one-out baseline needs K >= 2: set
            algorithm.samples_per_prompt >= 2), or bad shapes.
    """
    flat, inv, counts = _groups("leave_one_out_advantages", rewards, group_ids)
    if (counts < 2).any():
        raise ValueError("leave_one_out_advantages: the leave-one-out baseline needs K >= 2 samples "
                         f"per prompt group; smallest group has {int(counts.min())}. Set "
                         "algorithm.samples_per_prompt >= 2 and keep each group's samples together")
    flat = flat.detach()
    n = counts.to(flat.dtype)
    total = _group_sum(flat, inv, len(counts))
    baseline = (total[inv] - flat) / (n[inv] - 1.0)
    return (flat - baseline).reshape(rewards.shape)


def kl_penalized_rewards(rewards: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor,
                         ref_logprobs: torch.Tensor, kl_beta: float, estimator: str = "k1") -> torch.Tensor:
    """Sequence reward with the KL penalty folded in: ``r_i - beta * sum_t m k_t`` with ``k_t`` the
    ``estimator`` of KL(pi_old || pi_ref) on token t (k1: ``logp_old - logp_ref``, the default;
    k2, k3: :func:`~megatron_rlhf.losses._common.kl_estimate`).

    Ahmadian et al. 2024, sec. 2.1 (``R(x, y) = r(x, y) - beta log(pi/pi_ref)`` over the whole
    completion); Noukhovitch et al. 2024, sec. 2 (RLOO and PPO optimise the KL-penalised reward);
    the estimator choice as verl's ``algorithm.kl_penalty`` for ``use_kl_in_reward``.

    Args:
        rewards: ``[B]`` task rewards.
        mask: ``[B, T]`` float completion mask.
        old_logprobs: ``[B, T]`` pi_old token logprobs (the sampling policy's, as the learner recomputes).
        ref_logprobs: ``[B, T]`` reference token logprobs.
        kl_beta: penalty coefficient (>= 0; algorithm.kl_beta).
        estimator: ``k1`` | ``k2`` | ``k3`` (algorithm.kl_estimator).
    Returns:
        ``[B]`` penalised rewards, no grad.
    Raises:
        ValueError: shapes, ``kl_beta < 0`` or an unknown estimator.
    """
    check_tokens("kl_penalized_rewards", mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    if rewards.shape != (mask.shape[0],):
        raise ValueError(f"kl_penalized_rewards: rewards must be [B]={mask.shape[0]}; got "
                         f"{tuple(rewards.shape)}")
    if kl_beta < 0:
        raise ValueError(f"kl_penalized_rewards: kl_beta (algorithm.kl_beta) must be >= 0; got {kl_beta}")
    d = kl_estimate(old_logprobs.detach(), ref_logprobs, mask, estimator)
    return rewards.detach().float() - kl_beta * (d * mask).sum(-1)


def ppo_token_rewards(rewards: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor, kl_beta: float, estimator: str = "k1") -> torch.Tensor:
    """Per-token PPO rewards: ``-beta k_t`` on every completion token (``k_t`` the ``estimator`` of
    KL(pi_old || pi_ref); k1 = ``logp_old_t - logp_ref_t``, the default), plus the sequence reward
    on the LAST completion token.

    Ziegler et al. 2019, eq. 2 and Ouyang et al. 2022, eq. 2 (KL penalty in the reward, per token as
    in their implementations; Huang et al. 2024, "The N+ implementation details of RLHF with PPO").

    Args:
        rewards: ``[B]`` sequence rewards.
        mask: ``[B, T]`` float mask (each row needs >= 1 completion token).
        old_logprobs, ref_logprobs: ``[B, T]`` token logprobs.
        kl_beta: >= 0.
        estimator: ``k1`` | ``k2`` | ``k3`` (algorithm.kl_estimator).
    Returns:
        ``[B, T]`` token rewards, 0 outside the mask, no grad.
    Raises:
        ValueError: shapes, ``kl_beta < 0``, or a row without completion tokens.
    """
    check_tokens("ppo_token_rewards", mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)
    if rewards.shape != (mask.shape[0],):
        raise ValueError(f"ppo_token_rewards: rewards must be [B]={mask.shape[0]}; got "
                         f"{tuple(rewards.shape)}")
    if kl_beta < 0:
        raise ValueError(f"ppo_token_rewards: kl_beta (algorithm.kl_beta) must be >= 0; got {kl_beta}")
    has = mask.sum(-1) > 0
    if not bool(has.all()):
        raise ValueError("ppo_token_rewards: rows without completion tokens: "
                         f"{torch.nonzero(~has).flatten().tolist()}")
    d = kl_estimate(old_logprobs.detach(), ref_logprobs, mask, estimator)
    out = -kl_beta * d * mask
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).argmax(-1)
    out[torch.arange(mask.shape[0], device=mask.device), last] += rewards.detach().to(out.dtype)
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
        gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the completion tokens of each row.

    Schulman et al. 2016 (GAE), eq. 16: ``A_t = sum_l (gamma lam)^l delta_{t+l}`` with
    ``delta_t = r_t + gamma V_{t+1} - V_t`` (eq. 10) and ``V = 0`` after the last completion token.
    "Next" means the next MASKED position, so a completion interrupted by masked-out spans (tool
    output) is treated as one contiguous episode. Returns ``A + V`` as the value targets.

    Vectorised over the batch: one reverse scan over the ``T`` positions with ``[B]``-wide tensor ops
    (compared with a per-row Python loop in tests/test_losses.py).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (:func:`ppo_token_rewards`).
        values: ``[B, T]`` value estimates V(s_t) of the (old) critic.
        mask: ``[B, T]`` float mask.
        gamma: discount in [0, 1]; lam: GAE lambda in [0, 1].
    Returns:
        ``(advantages [B, T], returns [B, T])``, both 0 outside the mask, no grad.
    Raises:
        ValueError: shapes or gamma/lam outside [0, 1].
    """
    check_tokens("gae", mask, token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma (algorithm.gamma) and lam (algorithm.gae_lambda) must be in "
                         f"[0, 1]; got {gamma}, {lam}")
    on = mask > 0
    r = torch.where(on, token_rewards.detach(), torch.zeros_like(mask))
    v = torch.where(on, values.detach(), torch.zeros_like(mask))
    adv = torch.zeros_like(mask)
    next_value = torch.zeros_like(mask[:, 0])
    next_adv = torch.zeros_like(mask[:, 0])
    for t in range(mask.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(on[:, t], a_t, torch.zeros_like(a_t))
        next_value = torch.where(on[:, t], v[:, t], next_value)
        next_adv = torch.where(on[:, t], a_t, next_adv)
    return adv, (adv + v) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``x`` over the masked positions: ``(x - mean) / sqrt(var + eps)`` (population var).

    Standard PPO advantage normalisation (Huang et al. 2022, "37 implementation details of PPO",
    detail 7; TRL ``masked_whiten``). ``shift_mean=False`` keeps the mean (only rescales).

    Args:
        x: ``[B, T]``; mask: ``[B, T]`` float.
    Returns:
        ``[B, T]``, 0 outside the mask, no grad.
    """
    on = mask > 0
    xs = torch.where(on, x.detach(), torch.zeros_like(x))
    n = mask.sum().clamp_min(1.0)
    mean = (xs * mask).sum() / n
    var = (((xs - mean) * mask) ** 2).sum() / n
    out = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def ppo_advantages(rewards: torch.Tensor, mask: torch.Tensor, old_logprobs: torch.Tensor,
                   ref_logprobs: torch.Tensor, old_values: torch.Tensor, *, kl_beta: float,
                   gamma: float = 1.0, lam: float = 0.95, whiten: bool = True,
                   kl_estimator: str = "k1"
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's batch transform: KL-shaped token rewards -> GAE -> (optionally whitened) advantages.

    Composition of :func:`ppo_token_rewards`, :func:`gae` and :func:`masked_whiten` (Ouyang et al.
    2022, sec. 3.5 and eq. 2; Schulman et al. 2016, eq. 16). Call once on the whole batch.

    Args:
        rewards: ``[B]``; mask, old_logprobs, ref_logprobs, old_values: ``[B, T]``.
        kl_beta: per-token KL penalty (algorithm.kl_beta); gamma, lam: GAE parameters.
        whiten: whiten the advantages over the batch (algorithm.ppo_whiten_advantages).
        kl_estimator: the per-token KL estimator of the reward penalty (algorithm.kl_estimator).
    Returns:
        ``(advantages [B, T], returns [B, T], metrics)`` with metrics ``ppo/token_kl_penalty``
        (mean per-token penalty), ``ppo/return_mean``.
    Raises:
        ValueError: as in the composed functions.
    """
    tok = ppo_token_rewards(rewards, mask, old_logprobs, ref_logprobs, kl_beta, kl_estimator)
    adv, returns = gae(tok, old_values, mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    n = mask.sum().clamp_min(1.0)
    d = kl_estimate(old_logprobs.detach(), ref_logprobs, mask, kl_estimator)
    metrics = {"ppo/token_kl_penalty": -kl_beta * (d * mask).sum() / n,
               "ppo/return_mean": (returns * mask).sum() / n}
    return adv, returns, metrics


def best_of_k_mask(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Select the highest-reward completion of each group (first index on ties).

    Best-of-K / rejection-sampling SFT (the control of Noukhovitch et al. 2024, "Best-of-2 SFT";
    Touvron et al. 2023, sec. 3.2.3 rejection sampling).

    Args:
        rewards: ``[G, K]`` or ``[B]`` with ``group_ids [B]``.
        group_ids: ``[B]`` integer prompt ids or None.
    Returns:
        Float 0/1 mask of the selected rows, same shape as ``rewards`` (exactly one 1 per group).
    Raises:
        ValueError: bad shapes.
    """
    flat, inv, counts = _groups("best_of_k_mask", rewards, group_ids)
    g = len(counts)
    best = torch.full((g,), float("-inf"), dtype=flat.dtype, device=flat.device)
    best = best.scatter_reduce(0, inv, flat, reduce="amax")
    idx = torch.arange(flat.shape[0], device=flat.device)
    cand = torch.where(flat == best[inv], idx, torch.full_like(idx, flat.shape[0]))
    first = torch.full((g,), flat.shape[0], dtype=idx.dtype, device=flat.device)
    first = first.scatter_reduce(0, inv, cand, reduce="amin")
    out = torch.zeros_like(flat)
    out[first] = 1.0
    return out.reshape(rewards.shape)


def group_dpo_pairs(rewards: torch.Tensor, group_ids: torch.Tensor | None = None, *,
                    correct_threshold: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """All (correct, incorrect) index pairs within each prompt group (Lanchantin et al. 2025, eq. 4).

    A completion is correct iff its reward ``>= correct_threshold`` (math-verify gives 1.0/0.0).
    A group with 2 correct and 1 incorrect completion yields exactly 2 pairs; all-correct or
    all-incorrect groups yield none.

    Args:
        rewards: ``[G, K]`` or ``[B]`` with ``group_ids [B]``.
        group_ids: ``[B]`` integer prompt ids or None.
        correct_threshold: reward threshold for "correct" (algorithm.group_dpo_threshold).
    Returns:
        ``(chosen_idx [P], rejected_idx [P])`` long tensors indexing the flattened ``B`` rows,
        ordered by chosen then rejected index.
    Raises:
        ValueError: bad shapes.
    """
    flat, inv, _ = _groups("group_dpo_pairs", rewards, group_ids)
    correct = flat >= correct_threshold
    same = inv[:, None] == inv[None, :]
    pairs = torch.nonzero(same & correct[:, None] & ~correct[None, :])
    return pairs[:, 0], pairs[:, 1]
