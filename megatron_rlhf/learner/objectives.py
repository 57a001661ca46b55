"""The learner's side of ``algorithm.loss``: what each loss needs from a batch, its batch-level
transform (advantages), and one call of the pure loss function on a slice of the batch.

    x = check_batch(batch, algo, data_parallel=dp)           # CPU tensors, unit sizes
    spec = LossSpec.of(algo)                                   # what the loss needs
    prep = prepare_batch(algo, mask=x.mask, rewards=x.rewards, group_ids=x.group_ids, ...)
    loss, metrics = loss_on_slice(algo, SliceInputs(...), prep.totals)   # per micro-batch
    metrics = whole_batch_metrics(algo, x, prep, ...)                     # once, for the log

``MegatronLearner.train_step`` calls :func:`loss_on_slice` once per micro-batch (with grad, the
global denominators of the whole batch in ``totals``, so the micro-batch losses sum to the
whole-batch loss whatever the micro-batching and data parallelism) and once more on the whole
batch (no grad) for the logged metrics (:func:`whole_batch_metrics`). Everything here is a
function of CPU or device tensors; no torch.distributed.

| loss          | unit of micro-batching     | pi_old | batch transform (losses/advantages.py)     |
|---------------|----------------------------|--------|--------------------------------------------|
| online_dpo    | pair (rows 2i, 2i+1)       | -      | pair count                                 |
| group_dpo     | prompt group               | alpha>0| group_dpo_pairs (+ group_relative_adv.)    |
| grpo          | row                        | yes    | group_relative_advantages                  |
| ppo           | row                        | yes    | ppo_advantages (KL reward + GAE, critic)   |
| rloo          | row                        | kl_beta| kl_penalized_rewards, leave_one_out        |
| proximal_rloo | row                        | yes    | kl_penalized_rewards, leave_one_out        |
| best_of_k_sft | row (best of each group)   | -      | none (the batch holds the selected rows)   |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rlhf.config import AlgorithmConfig
from megatron_rlhf.losses import advantages as adv_fns
from megatron_rlhf.losses.dpo import group_dpo_loss, online_dpo_loss
from megatron_rlhf.losses.grpo import grpo_loss
from megatron_rlhf.losses.ppo import ppo_loss
from megatron_rlhf.losses.rloo import proximal_rloo_loss, rloo_loss
from megatron_rlhf.losses.sft import best_of_k_sft_loss

__all__ = ["LossSpec", "BatchTotals", "Prepared", "SliceInputs", "BatchTensors", "check_batch",
           "prepare_batch", "loss_on_slice", "sequence_sums", "assemble", "microbatch_inputs",
           "whole_batch_metrics"]

@dataclass(frozen=True)
class LossSpec:
    """What ``algorithm.loss`` needs from the learner, derived once from the config.

    Attributes:
        keeps_units: rows of a unit (pair or prompt group) must share a micro-batch (online_dpo,
            group_dpo); False: rows are independent once the advantages are computed.
        uses_old: the loss takes pi_old token logprobs (ratio or TIS).
        kl_in_reward: the KL to the reference is folded into the reward with pi_old
            (``algorithm.kl_in_reward``, by default ppo, rloo and proximal_rloo, with
            ``kl_beta > 0``), so pi_old is needed before the first update.
        recompute_old: pi_old comes from an extra forward-only pass of the policy before the first
            update (``uses_old`` and T > 1, or ``kl_in_reward``); otherwise, when ``uses_old``,
            pi_old is the detached logprobs of the first (only) update's own forward: the same
            weights on the same tokens, so the ratio is exactly 1 and the clip inactive.
        uses_entropy: the policy's per-token entropy enters the loss (``entropy_coef > 0``).
        temperature_applies: policy-gradient losses see logprobs of ``logits / temperature``.
    """

    keeps_units: bool
    uses_old: bool
    kl_in_reward: bool
    recompute_old: bool
    uses_entropy: bool
    temperature_applies: bool

    @staticmethod
    def of(algo: AlgorithmConfig) -> "LossSpec":
        name = algo.loss
        grpo_part = name == "group_dpo" and algo.group_dpo_alpha > 0
        uses_old = name in ("grpo", "ppo", "proximal_rloo") or grpo_part
        kl_in_reward = algo.is_policy_gradient and algo.kl_in_reward_used and algo.kl_beta > 0
        return LossSpec(
            keeps_units=algo.unit == "pair" or name == "group_dpo", uses_old=uses_old,
            kl_in_reward=kl_in_reward,
            recompute_old=(uses_old and algo.updates_per_batch > 1) or kl_in_reward,
            uses_entropy=algo.entropy_coef > 0 and (algo.is_policy_gradient or grpo_part),
            temperature_applies=algo.is_policy_gradient)


@dataclass(frozen=True)
class BatchTotals:
    """Denominators of the whole batch (all micro-batches, all DP ranks).

    Attributes:
        num_sequences: rows ``B`` with a completion token; num_tokens: completion tokens (``loss_mask.sum()``);
        num_pairs: DPO pairs (online_dpo: ``B/2``; group_dpo: (correct, incorrect) pairs), else 0.
    """

    num_sequences: float
    num_tokens: float
    num_pairs: float = 0.0


@dataclass
class Prepared:
    """Output of :func:`prepare_batch` for the whole batch (CPU tensors).

    Attributes:
        totals: the batch's denominators.
        advantages: ``[B]`` (grpo, rloo, proximal_rloo, group_dpo with alpha > 0) or ``[B, S]``
            (ppo), else None.
        returns: ``[B, S]`` value targets (ppo), else None.
        metrics: batch-transform metrics (``reward/loss_mean`` and ``reward/loss_std``: the rewards the
            loss sees, after per-task normalisation; ``ppo/*``, ...), floats.
    """

    totals: BatchTotals
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SliceInputs:
    """Rows of the batch for one loss call (a micro-batch, or the whole batch for metrics).

    All ``[b, s]`` tensors share one device and column alignment (``log p(x_t | x_<t)`` at column
    t, :mod:`megatron_rlhf.learner.logprobs`). Optional ones are None when the loss does not use
    them.

    Attributes:
        logprobs: current policy token logprobs (with grad in training).
        mask: float completion mask.
        ref_logprobs: reference token logprobs.
        old_logprobs: pi_old token logprobs.
        generator_logprobs: the generator's sampling logprobs (TIS), or None.
        rewards: ``[b]`` loss rewards; group_ids: ``[b]`` prompt ids.
        advantages: ``[b]`` or ``[b, s]`` (rows of :attr:`Prepared.advantages`).
        entropy: per-token policy entropy (with grad in training).
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    generator_logprobs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def sequence_sums(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` token values and mask -> ``[b]`` float32 masked row sums, accumulated in float64 so
    a row's sum does not depend on how long its micro-batch is padded (differentiable)."""
    m = mask.to(values.device).double()
    return (torch.where(m > 0, values.double(), torch.zeros_like(m)) * m).sum(-1).float()


def prepare_batch(algo: AlgorithmConfig, *, mask: torch.Tensor, rewards: torch.Tensor | None,
                  group_ids: torch.Tensor | None, ref_logprobs: torch.Tensor | None = None,
                  old_logprobs: torch.Tensor | None = None,
                  old_values: torch.Tensor | None = None) -> Prepared:
    """The batch-level transform of ``algorithm.loss``, once per batch on the whole batch.

    The KL in the reward (:attr:`LossSpec.kl_in_reward`: ``algorithm.kl_in_reward``, by default
    ppo / rloo / proximal_rloo with ``kl_beta > 0``) is ``kl_beta * sum_t k_t(pi_old || pi_ref)``
    with ``k`` = ``algorithm.kl_estimator`` (default k1: ``log pi_old - log pi_ref``; Ahmadian et
    al. 2024, sec. 2.1), subtracted from each reward before the advantages.
    grpo: :func:`~megatron_rlhf.losses.advantages.group_relative_advantages`
    (``algorithm.grpo_normalize_std``); rloo / proximal_rloo: leave-one-out advantages;
    ppo: :func:`~megatron_rlhf.losses.advantages.ppo_advantages` with the critic's old values
    (KL-shaped token rewards, GAE(gamma, gae_lambda), whitening; the penalty per token);
    group_dpo: the number of (correct, incorrect) pairs of the batch (+ GRPO advantages when
    ``group_dpo_alpha > 0``); online_dpo: ``B/2`` pairs; best_of_k_sft: nothing.

    Args:
        algo: the algorithm config.
        mask: ``[B, S]`` float completion mask of the whole batch.
        rewards: ``[B]`` loss rewards (None for online_dpo / best_of_k_sft batches without them).
        group_ids: ``[B]`` prompt ids (None: online_dpo from pairs).
        ref_logprobs, old_logprobs: ``[B, S]`` (needed for the KL in the reward: ppo always; rloo /
            proximal_rloo when ``kl_beta > 0``). With ``kl_beta = 0`` ppo may get
            ``old_logprobs=None``: the penalty ``0 * (old - ref)`` is then taken as 0.
        old_values: ``[B, S]`` critic values at rollout time (ppo).
    Returns:
        :class:`Prepared`.
    Raises:
        ValueError: a needed input is missing (names the algorithm.loss), or the transforms'
            own errors (e.g. an RLOO group with one sample).
    """
    name = algo.loss
    b = mask.shape[0]
    # sequences with a completion token: a row whose loss_mask is all 0 (algorithm.overlong: mask)
    # is no trained sequence (NeMo-RL's global_valid_seqs)
    totals = BatchTotals(num_sequences=float((mask.sum(-1) > 0).sum()), num_tokens=float(mask.sum()))
    if name == "online_dpo":
        return Prepared(totals=BatchTotals(totals.num_sequences, totals.num_tokens, float(b // 2)))
    if name == "best_of_k_sft":
        return Prepared(totals=totals)
    if rewards is None or group_ids is None:
        raise ValueError(f"algorithm.loss={name} needs batch.rewards and batch.group_ids "
                         "(build the batch with LearnerBatch.from_groups)")
    rewards = rewards.float()
    metrics = {"reward/loss_mean": float(rewards.mean()), "reward/loss_std": float(rewards.std(unbiased=False))}
    in_reward = LossSpec.of(algo).kl_in_reward
    if name in ("grpo", "group_dpo"):
        adv = None
        if name == "grpo" or algo.group_dpo_alpha > 0:
            r = _kl_penalized(algo, name, rewards, mask, ref_logprobs, old_logprobs, metrics) if in_reward else rewards
            adv = adv_fns.group_relative_advantages(r, group_ids, normalize_std=algo.grpo_normalize_std)
        pairs = 0.0
        if name == "group_dpo":
            chosen, _ = adv_fns.group_dpo_pairs(rewards, group_ids,
                                                correct_threshold=algo.group_dpo_threshold)
            pairs = float(chosen.numel())
        return Prepared(totals=BatchTotals(totals.num_sequences, totals.num_tokens, pairs),
                        advantages=adv, metrics=metrics)
    if name in ("rloo", "proximal_rloo"):
        r = _kl_penalized(algo, name, rewards, mask, ref_logprobs, old_logprobs, metrics) if in_reward else rewards
        return Prepared(totals=totals, advantages=adv_fns.leave_one_out_advantages(r, group_ids),
                        metrics=metrics)
    if name == "ppo":
        _need(name, ref_logprobs=ref_logprobs, old_values=old_values)
        if old_logprobs is None:
            if in_reward:
                _need(name, old_logprobs=old_logprobs)
            old_logprobs = ref_logprobs  # no KL in the reward: the penalty 0 * k(old, ref) is 0 anyway
        adv, ret, m = adv_fns.ppo_advantages(rewards, mask, old_logprobs, ref_logprobs, old_values,
                                             kl_beta=algo.kl_beta if in_reward else 0.0,
                                             gamma=algo.gamma, lam=algo.gae_lambda,
                                             whiten=algo.whiten_advantages,
                                             kl_estimator=algo.kl_estimator_used)
        metrics.update({k: float(v) for k, v in m.items()})
        return Prepared(totals=totals, advantages=adv, returns=ret, metrics=metrics)
    raise ValueError(f"algorithm.loss={name!r} is not handled by the learner")


def _kl_penalized(algo: AlgorithmConfig, name: str, rewards, mask, ref_logprobs, old_logprobs,
                  metrics: dict) -> torch.Tensor:
    """``[B]`` rewards minus ``kl_beta * sum_t k_t(pi_old || pi_ref)`` (``algorithm.kl_estimator``);
    logs ``reward/kl_penalty_mean``."""
    _need(name, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs)
    r = adv_fns.kl_penalized_rewards(rewards, mask, old_logprobs, ref_logprobs, algo.kl_beta,
                                     algo.kl_estimator_used)
    metrics["reward/kl_penalty_mean"] = float((rewards - r).mean())
    return r


def _need(name: str, **tensors) -> None:
    missing = [k for k, v in tensors.items() if v is None]
    if missing:
        raise ValueError(f"algorithm.loss={name}: missing {', '.join(missing)} for the batch transform")


def loss_on_slice(algo: AlgorithmConfig, x: SliceInputs, totals: BatchTotals
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One call of the ``algorithm.loss`` function on the rows ``x`` with the whole batch's
    denominators ``totals``.

    The knobs come from ``algo`` (beta, nll_coef, group_dpo_alpha, clip_eps, clip_eps_high,
    kl_beta (in the loss unless :attr:`LossSpec.kl_in_reward`), kl_estimator, is_correction,
    is_bounds and tis_cap (only when ``x.generator_logprobs`` is given), loss_agg (None: the
    loss's default), proximal_rloo_level, entropy_coef). ppo's policy part only: the critic trains
    separately (``values=None``). online_dpo takes rows 2i / 2i+1 of ``x`` as pair i's chosen /
    rejected, sequence logprobs summed in float64 (:func:`sequence_sums`), chosen lengths for the
    NLL term clamped to >= 1 token.

    Returns:
        ``(loss, metrics)`` of the loss function (``loss`` differentiable through
        ``x.logprobs`` / ``x.entropy``); online_dpo adds ``logprobs/policy_chosen_mean``.
    Raises:
        ValueError: the loss function's errors (shapes, missing inputs).
    """
    name = algo.loss
    lp, mask, ref = x.logprobs, x.mask, x.ref_logprobs
    agg = {} if algo.loss_agg is None else {"loss_agg": algo.loss_agg}
    glob = dict(global_num_sequences=totals.num_sequences, global_num_tokens=totals.num_tokens)
    ent = dict(entropy=x.entropy, entropy_coef=algo.entropy_coef if x.entropy is not None else 0.0)
    gen = x.generator_logprobs is not None
    pg = dict(clip_eps=algo.clip_eps, clip_eps_high=algo.clip_eps_high,
              generator_logprobs=x.generator_logprobs, tis_cap=algo.tis_cap if gen else None,
              is_correction=algo.is_correction if gen else "none", is_bounds=tuple(algo.is_bounds),
              kl_estimator=algo.kl_estimator_used, **ent, **agg, **glob)
    kl_beta = 0.0 if LossSpec.of(algo).kl_in_reward else algo.kl_beta   # the KL term of the loss
    if name == "online_dpo":
        seq, ref_seq = sequence_sums(lp, mask), sequence_sums(ref, mask)
        lengths = mask.sum(-1).clamp_min(1.0).to(seq.dtype)
        loss, m = online_dpo_loss(seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], algo.beta,
                                  chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2],
                                  nll_coef=algo.nll_coef, global_num_pairs=totals.num_pairs)
        m["logprobs/policy_chosen_mean"] = seq[0::2].detach().mean()
        return loss, m
    if name == "group_dpo":
        grpo_opts = {}
        if algo.group_dpo_alpha > 0:
            grpo_opts = dict(kl_beta=algo.kl_beta, **pg)
        return group_dpo_loss(lp, ref, mask, x.rewards, algo.beta, group_ids=x.group_ids,
                              correct_threshold=algo.group_dpo_threshold,
                              global_num_pairs=totals.num_pairs, alpha=algo.group_dpo_alpha,
                              old_logprobs=x.old_logprobs, advantages=x.advantages, **grpo_opts)
    if name == "grpo":
        return grpo_loss(lp, x.old_logprobs, x.advantages, mask, ref_logprobs=ref, kl_beta=kl_beta, **pg)
    if name == "ppo":
        return ppo_loss(lp, x.old_logprobs, x.advantages, mask, ref_logprobs=ref, kl_beta=kl_beta, **pg)
    if name == "rloo":
        return rloo_loss(lp, x.advantages, mask, ref_logprobs=ref, generator_logprobs=x.generator_logprobs,
                         tis_cap=pg["tis_cap"], is_correction=pg["is_correction"],
                         is_bounds=pg["is_bounds"], kl_beta=kl_beta, kl_estimator=pg["kl_estimator"],
                         **ent, **agg, **glob)
    if name == "proximal_rloo":
        return proximal_rloo_loss(lp, x.old_logprobs, x.advantages, mask,
                                  level=algo.proximal_rloo_level, ref_logprobs=ref, kl_beta=kl_beta, **pg)
    if name == "best_of_k_sft":
        return best_of_k_sft_loss(lp, mask, ref_logprobs=ref, **agg, **glob)
    raise ValueError(f"algorithm.loss={name!r} is not handled by the learner")


# ----------------------------------------------------------------------------- batch plumbing
@dataclass(frozen=True)
class BatchTensors:
    """A validated learner batch as CPU tensors (:func:`check_batch`).

    Attributes:
        ids: ``[B, S]`` int64; mask: ``[B, S]`` float32 completion mask; slp: ``[B, S]`` float32
            generator sampling logprobs or None.
        rewards: ``[B]`` float32 or None; group_ids: ``[B]`` int64 or None.
        unit: ``pair`` / ``group`` / ``best``.
        units: sizes of the consecutive row runs micro-batching keeps together (2 per pair, a
            group's size for group_dpo, 1 per row otherwise).
        num_units: trained prompts (``LearnerBatch.num_units``).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    slp: torch.Tensor | None
    rewards: torch.Tensor | None
    group_ids: torch.Tensor | None
    unit: str
    units: list[int]
    num_units: int


def check_batch(batch, algo: AlgorithmConfig, *, data_parallel: int = 1) -> BatchTensors:
    """Validate a ``LearnerBatch`` against ``algorithm.loss`` and convert it to CPU tensors.

    A batch without ``group_ids`` (rows 2i / 2i+1 chosen / rejected, built by hand) is a ``pair`` batch.

    Raises:
        ValueError: the batch's unit is not ``algo.unit`` (the message names algorithm.loss),
            a pair batch without an even row count ``[2P, S]``, shapes that differ, rows of a
            group_dpo group not adjacent, or fewer units than ``data_parallel`` ranks.
    """
    from megatron_rlhf.learner.batching import unit_sizes

    ids = torch.as_tensor(batch.input_ids, dtype=torch.long)
    mask = torch.as_tensor(batch.loss_mask, dtype=torch.float32)
    gids = None if batch.group_ids is None else torch.as_tensor(batch.group_ids, dtype=torch.long)
    unit = "pair" if gids is None else batch.unit
    if unit != algo.unit:
        raise ValueError(f"train_step: the batch's unit is {unit!r} but algorithm.loss={algo.loss} "
                         f"trains on {algo.unit!r} units; build it with "
                         f"LearnerBatch.from_groups(groups, unit={algo.unit!r}, ...)")
    bad = ids.dim() != 2 or ids.shape[0] == 0 or mask.shape != ids.shape
    if unit == "pair" and (bad or ids.shape[0] % 2):
        raise ValueError(f"train_step: input_ids {tuple(ids.shape)} must be [2P, S] with P >= 1 "
                         f"and loss_mask the same shape (got {tuple(mask.shape)})")
    if bad:
        raise ValueError(f"train_step: input_ids {tuple(ids.shape)} must be [B, S] with B >= 1 "
                         f"and loss_mask the same shape (got {tuple(mask.shape)})")
    b = ids.shape[0]
    rewards = None if batch.rewards is None else torch.as_tensor(batch.rewards, dtype=torch.float32)
    slp = None if batch.sampling_logprobs is None else torch.as_tensor(batch.sampling_logprobs,
                                                                        dtype=torch.float32)
    for name, t, shape in (("group_ids", gids, (b,)), ("rewards", rewards, (b,)),
                           ("sampling_logprobs", slp, tuple(ids.shape))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"train_step: batch.{name} must be {list(shape)}; got {list(t.shape)}")
    if unit == "pair":
        units, what = [2] * (b // 2), "pairs"
        if gids is not None and unit_sizes(gids) != units:
            raise ValueError("train_step: a pair batch needs exactly 2 adjacent rows per group_id")
    elif algo.loss == "group_dpo":
        units, what = unit_sizes(gids), "groups"
    else:
        units, what = [1] * b, "rows"
    if len(units) < data_parallel:
        raise ValueError(f"train_step: {len(units)} {what} cannot be split over learner.data_parallel="
                         f"{data_parallel} ranks; set algorithm.prompts_per_step >= {data_parallel}")
    return BatchTensors(ids=ids, mask=mask, slp=slp, rewards=rewards, group_ids=gids, unit=unit,
                        units=units, num_units=int(batch.num_units))


def assemble(parts: list[list[tuple]], b: int, s: int) -> torch.Tensor:
    """``[B, S]`` float32 CPU tensor from every DP rank's list of ``(rows, [b_k, s_k] tensor)``;
    columns beyond ``S`` (micro-batch padding) are dropped, positions no micro-batch covers stay 0."""
    out = torch.zeros(b, s)
    for part in parts:
        for rows, t in part:
            w = min(s, t.shape[1])
            out[list(rows), :w] = t[:, :w].float().cpu()
    return out


def microbatch_inputs(rows, seq_len: int, mask: torch.Tensor, x: BatchTensors, prep: Prepared,
                      ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None,
                      generator_logprobs: torch.Tensor | None) -> SliceInputs:
    """CPU :class:`SliceInputs` of one micro-batch (rows ``rows`` cut to ``seq_len`` columns;
    ``mask``, ``ref_logprobs``, ``old_logprobs``, ``generator_logprobs`` already cut), without
    the current logprobs / entropy (set per forward)."""
    from megatron_rlhf.learner.schedule import cut_rows

    rows = list(rows)
    adv = prep.advantages
    if adv is not None:
        adv = cut_rows(adv, rows, seq_len, 0.0) if adv.dim() == 2 else adv[rows]
    return SliceInputs(
        logprobs=None, mask=mask, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs,
        generator_logprobs=generator_logprobs,
        rewards=None if x.rewards is None else x.rewards[rows],
        group_ids=None if x.group_ids is None else x.group_ids[rows], advantages=adv)


def whole_batch_metrics(algo: AlgorithmConfig, x: BatchTensors, prep: Prepared, *,
                        ref_logprobs: torch.Tensor, first_logprobs: torch.Tensor,
                        last_logprobs: torch.Tensor | None, old_logprobs: torch.Tensor | None,
                        entropy: torch.Tensor | None,
                        sampling_temperature_logprobs: torch.Tensor | None = None) -> dict[str, float]:
    """The logged metrics of one batch, from ``[B, S]`` tensors of the whole batch (no grad).

    Args:
        algo, x, prep: the batch and its transform.
        ref_logprobs: reference token logprobs.
        first_logprobs: the policy's token logprobs of the first update's forward (the weights
            before this batch).
        last_logprobs: those of the last update's forward when T > 1, else None.
        old_logprobs: pi_old (None: ``first_logprobs`` when the loss uses pi_old).
        entropy: per-token entropy of the last update's forward, or None.
        sampling_temperature_logprobs: the policy's token logprobs (weights before this batch)
            at the generators' sampling temperature when the loss trains at another one (DPO /
            SFT losses at T != 1), else None (``first_logprobs`` already are).
    Returns:
        the loss function's metrics on the last update's logprobs (+ ``loss/total_first_update``
        when T > 1), ``prep.metrics``, ``kl/ref_k1``, ``kl/ref_k2``, ``kl/ref_k3`` from ``first_logprobs``,
        the train/inference mismatch at the sampling temperature (same weights, same
        distribution, so only numerics or a failed weight sync make it non-zero):
        ``logprobs/vllm_gap_abs_mean``, ``logprobs/vllm_gap_abs_max`` and
        ``logprobs/token_mult_prob_error`` = mean over tokens of exp(|learner - generator|)
        (NeMo-RL ``token_mult_prob_error``; 1.0 is a perfect match, its recipe tests require
        < 1.05); and ``rollout/entropy_mc`` (these over completion tokens with a finite generator
        logprob; NaN without them).
    """
    from megatron_rlhf.losses._common import kl_metrics

    spec = LossSpec.of(algo)
    if old_logprobs is None and spec.uses_old:
        old_logprobs = first_logprobs
    current = first_logprobs if last_logprobs is None else last_logprobs
    sl = SliceInputs(logprobs=current, mask=x.mask, ref_logprobs=ref_logprobs,
                     old_logprobs=old_logprobs, generator_logprobs=x.slp, rewards=x.rewards,
                     group_ids=x.group_ids, advantages=prep.advantages, entropy=entropy)
    with torch.no_grad():
        out = {k: float(v) for k, v in loss_on_slice(algo, sl, prep.totals)[1].items()}
        if last_logprobs is not None:
            sl.logprobs = first_logprobs
            out["loss/total_first_update"] = float(loss_on_slice(algo, sl, prep.totals)[1]["loss/total"])
    out.update(prep.metrics)
    out.update({k: float(v) for k, v in kl_metrics(first_logprobs, ref_logprobs, x.mask).items()})
    on = x.mask > 0
    if x.slp is not None:
        on = on & torch.isfinite(x.slp)  # as TIS does: skip non-finite generator logprobs
    if x.slp is None or not bool(on.any()):
        nan = float("nan")
        out.update({"logprobs/vllm_gap_abs_mean": nan, "logprobs/vllm_gap_abs_max": nan,
                    "logprobs/token_mult_prob_error": nan, "rollout/entropy_mc": nan})
    else:
        learner = first_logprobs if sampling_temperature_logprobs is None else sampling_temperature_logprobs
        gap = (learner - x.slp).abs()[on].double()
        out.update({"logprobs/vllm_gap_abs_mean": float(gap.mean()),
                    "logprobs/vllm_gap_abs_max": float(gap.max()),
                    "logprobs/token_mult_prob_error": float(torch.exp(gap).mean()),
                    "rollout/entropy_mc": float(-x.slp[on].mean())})
    return out
