"""The PPO critic: a value model on its own Megatron parameters, trained with the clipped value loss.

    critic = Critic(learner)                       # learner: a MegatronLearner (algorithm.loss=ppo)
    old = critic.values(mbs)                       # [b_k, s_k] per micro-batch, last stage
    m = critic.train_step(mbs, old, returns, global_num_sequences=B, global_num_tokens=N_tok,
                          loss_agg="token_mean")

Model (Schulman et al. 2017, PPO with a value function V(s_t); as in Stiennon et al. 2020 sec.
3.4 and Ouyang et al. 2022 the value model has its own parameters, separate from the policy's):
a GPTModel built exactly like the learner's policy (same TransformerConfig, process groups,
pipeline stage, platform layer spec) and started from the policy's HF weights
(``learner.model_dir``; those papers start it from the reward model instead), whose vocab output
layer is replaced on the last stage by :class:`ValueHead`, a replicated ``Linear(hidden, 1)`` in
float32, zero-initialised (the first values are 0, and every TP rank starts identical without
RNG coordination).

* Tied embeddings (SmolLM2): the critic is untied -- ``share_embeddings_and_output_weights`` is
  switched off after the HF weights are loaded, so the head receives no embedding weight, megatron's
  ``finalize_model_grads`` does not all-reduce embedding grads between the first and last stage,
  and the input embedding trains from the input side only.
* TP: the head's inputs are the (replicated) final hidden states; with sequence parallelism they
  arrive split along the sequence and are all-gathered first
  (``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=False)``: every TP rank
  computes the same loss, so the backward only splits the gradient). The head's weights get the
  same gradient on every TP rank and are an ordinary replicated parameter to megatron's DDP and
  optimizer (counted once in the grad norm).
* PP / DP: :mod:`megatron_rlhf.learner.value_schedule` (megatron's pipeline schedule for PP > 1);
  megatron DDP averages grads over DP, so each micro-batch loss is scaled by
  ``len(mbs) * dp`` (megatron divides by the number of micro-batches) and the summed
  :func:`~megatron_rlhf.losses.ppo.ppo_value_loss` with global denominators gives exactly the
  gradient of the whole-batch loss on one process.

Optimizer: its own megatron DDP, ``get_megatron_optimizer`` (Adam with the learner's betas, eps,
weight decay, clipping and distributed-optimizer setting; lr ``algorithm.critic_lr`` or
``learner.optimizer.lr``) and ``OptimizerParamScheduler`` with the learner's schedule (same warmup,
decay style and length; ``min_lr`` scaled by ``critic_lr / lr``).

Every public method is collective over the learner's ranks, like the learner's own verbs.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from megatron_rlhf.learner import parallel
from megatron_rlhf.learner.model import build_gpt_model
from megatron_rlhf.learner.optim import all_finite, build_train_state
from megatron_rlhf.learner.schedule import MicroBatchData
from megatron_rlhf.learner.value_schedule import run_value_microbatches
from megatron_rlhf.learner.weights import load_hf_weights, mark_tensor_parallel
from megatron_rlhf.losses.ppo import ppo_value_loss

__all__ = ["Critic", "ValueHead"]

log = logging.getLogger(__name__)


class ValueHead(torch.nn.Module):
    """Scalar value head standing in for GPTModel's ``output_layer`` (last pipeline stage).

    Called by megatron-core's ``GPTModel._postprocess`` as
    ``output_layer(hidden, weight=..., runtime_gather_output=...)``; ``weight`` (the tied
    embedding, only passed when embeddings are shared) and ``runtime_gather_output`` are ignored.

    Args:
        hidden_size: model hidden size h.
        tp_group: tensor-parallel process group (used with ``sequence_parallel``).
        sequence_parallel: hidden states arrive split along the sequence over TP ranks.
        device: parameter device.
    Attributes:
        weight: ``[1, h]`` float32, zeros. bias: ``[1]`` float32, zero. (Named like a Linear's so
            megatron's ``LanguageModule.sharded_state_dict`` finds ``output_layer.weight``.)
    """

    def __init__(self, hidden_size: int, *, tp_group=None, sequence_parallel: bool = False,
                 device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))
        self.tp_group = tp_group
        self.sequence_parallel = bool(sequence_parallel)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        """``hidden [s(/tp), b, h]`` -> ``(values [s, b, 1] float32, None)``."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return torch.nn.functional.linear(hidden.float(), self.weight, self.bias), None


class Critic:
    """PPO value model of one learner rank (see module doc).

    Args:
        learner: the :class:`~megatron_rlhf.learner.actor.MegatronLearner` of this rank; read for
            ``hf_config``, ``tconfig``, ``groups``, ``platform``, ``model_dir``, ``cfg``, ``algo``,
            ``padded_vocab``, ``dtype``, ``tp_rank``, ``sequence_parallel`` and
            ``_lr_schedule_args()`` (no reference to it is kept).
    Attributes:
        model: the critic GPTModel of this pipeline stage (``ValueHead`` as ``output_layer`` on
            the last stage); ``ddp``, ``optimizer``, ``scheduler``: its megatron DDP, optimizer
            and LR scheduler; ``lr``: peak learning rate.
    """

    def __init__(self, learner):
        t0 = time.perf_counter()
        self.groups, self.platform = learner.groups, learner.platform
        self.algo = learner.algo
        self.dtype = learner.dtype
        # own copy: DDP's no_sync_func and the schedules read the model's config object
        self.tconfig = copy.copy(learner.tconfig)
        self.model = self._build(learner)
        self.lr = float(learner.algo.critic_lr or learner.cfg.optimizer.lr)
        self.ddp, self.optimizer, self.scheduler = self._build_optimizer(learner)
        self._closed = False
        log.info("Critic rank %d ready in %.1f s (%d local params, lr %g)", self.groups.rank,
                 time.perf_counter() - t0, sum(p.numel() for p in self.model.parameters()), self.lr)

    # ----------------------------------------------------------------------------- building
    def _build(self, learner):
        """The policy's GPTModel with the policy's HF weights, output layer -> ValueHead, untied."""
        g = self.groups
        model = build_gpt_model(learner.hf_config, self.tconfig, platform=self.platform,
                                pg_collection=g.pg_collection, pre_process=g.is_first_stage,
                                post_process=g.is_last_stage, vocab_size=learner.padded_vocab)
        mark_tensor_parallel(model, learner.hf_config)
        load_hf_weights(model, learner.model_dir, learner.hf_config, tp_rank=learner.tp_rank,
                        tp=g.tp, padded_vocab=learner.padded_vocab)
        if g.is_last_stage:
            model.output_layer = ValueHead(self.tconfig.hidden_size, tp_group=g.pg_collection.tp,
                                           sequence_parallel=learner.sequence_parallel,
                                           device=self.platform.device)
        model.share_embeddings_and_output_weights = False  # see module doc (tied embeddings)
        return model

    def _build_optimizer(self, learner):
        """Megatron DDP + optimizer + scheduler (:mod:`megatron_rlhf.learner.optim`, the policy's
        recipe) at the critic's learning rate."""
        st = build_train_state(module=self.model, tconfig=self.tconfig, groups=self.groups,
                               platform=self.platform, optimizer_cfg=learner.cfg.optimizer, dtype=self.dtype,
                               distributed_optimizer=learner.cfg.distributed_optimizer,
                               schedule_args=learner._lr_schedule_args(), lr=self.lr)
        self.overlap_grad_reduce, self.use_distributed_optimizer = st.overlap_grad_reduce, st.use_distributed_optimizer
        return st.ddp, st.optimizer, st.scheduler

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Critic is closed")

    def _run(self, mbs, on_values, *, forward_only: bool) -> None:
        run_value_microbatches(self.ddp, mbs, on_values, forward_only=forward_only, pp=self.groups.pp,
                               pg_collection=self.groups.pg_collection,
                               no_sync=self.ddp.no_sync if self.overlap_grad_reduce and not forward_only
                               else None)

    def _gather_dp(self, obj) -> list:
        """``obj`` of every DP rank of this (TP rank, PP stage), in DP rank order."""
        return parallel.gather_dp(self.groups, obj)

    # ----------------------------------------------------------------------------- values
    def values(self, mbs: list[MicroBatchData]) -> list[torch.Tensor] | None:
        """Critic values of this rank's micro-batches (forward only, eval mode).

        Args:
            mbs: micro-batches (:func:`~megatron_rlhf.learner.schedule.make_microbatch`), the same
                list on every pipeline stage.
        Returns:
            on last-stage ranks, per micro-batch a ``[b_k, s_k]`` float32 CPU tensor in reward
            units: column t = V(x_<t) = head(h_{t-1}) (column 0 = 0), multiplied by the
            micro-batch's ``loss_mask`` (so 0 off the completion; unmasked when it is None);
            None on other pipeline stages.
        """
        self._check_open()
        out: list = [None] * len(mbs)

        def keep(k, mb, vals):
            v = vals.detach().float().cpu()
            out[k] = v if mb.loss_mask is None else v * mb.loss_mask.to(v.dtype)

        was_training = self.model.training
        self.model.eval()
        try:
            self._run(mbs, keep, forward_only=True)
        finally:
            self.model.train(was_training)
        return out if self.groups.is_last_stage else None

    # ----------------------------------------------------------------------------- training
    def train_step(self, mbs: list[MicroBatchData], old_values: list[torch.Tensor],
                   returns: list[torch.Tensor], *, global_num_sequences: float,
                   global_num_tokens: float, loss_agg: str) -> dict[str, float]:
        """One optimizer step of the clipped value loss (Huang et al. 2022 detail 9;
        :func:`~megatron_rlhf.losses.ppo.ppo_value_loss` with ``algorithm.value_clip_eps``).
        When any rank's value loss or gradient is not finite (``optim.all_finite``, collective),
        every rank zeroes the critic's gradients and skips its LR and optimizer steps, as the
        policy's update does.

        Args:
            mbs: this rank's micro-batches (``loss_mask`` required), same list on every stage.
            old_values: per micro-batch ``[b_k, s_k]`` values at rollout time (:meth:`values`).
            returns: per micro-batch ``[b_k, s_k]`` value targets (GAE advantages + old values).
            global_num_sequences, global_num_tokens: sequences / completion tokens of the whole
                batch over all DP ranks (the loss denominators).
            loss_agg: ``sequence_sum``, ``sequence_token_mean`` or ``token_mean``.
        Returns:
            every rank: ``critic/grad_norm`` (global, before clipping; NaN when skipped),
            ``critic/lr``, ``critic/skipped_nonfinite`` (1.0 when the step was skipped); last-stage
            ranks add ``value/loss``, ``value/clip_frac``, ``value/pred_mean``,
            ``value/return_mean``, ``value/abs_error`` over the whole batch (all DP ranks), from
            the values before this step.
        Raises:
            ValueError: list lengths or shapes differ from ``mbs``, or a micro-batch has no mask.
        """
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        self._check_open()
        if len(old_values) != len(mbs) or len(returns) != len(mbs):
            raise ValueError(f"Critic.train_step: {len(mbs)} micro-batches but {len(old_values)} "
                             f"old_values and {len(returns)} returns")
        for k, mb in enumerate(mbs):
            shape = tuple(mb.input_ids.shape)
            if mb.loss_mask is None or tuple(mb.loss_mask.shape) != shape \
                    or tuple(old_values[k].shape) != shape or tuple(returns[k].shape) != shape:
                raise ValueError(f"Critic.train_step: micro-batch {k} has input_ids {shape}, loss_mask "
                                 f"{None if mb.loss_mask is None else tuple(mb.loss_mask.shape)}, "
                                 f"old_values {tuple(old_values[k].shape)}, returns "
                                 f"{tuple(returns[k].shape)}; all must be equal")
        scale = len(mbs) * self.groups.dp  # megatron divides by len(mbs), DDP averages over DP
        kw = dict(value_clip_eps=self.algo.value_clip_eps, loss_agg=loss_agg,
                  global_num_sequences=float(global_num_sequences),
                  global_num_tokens=float(global_num_tokens))
        records: list[tuple] = []
        losses: list[torch.Tensor] = []

        def value_microbatch(k, mb, vals):
            dev = vals.device
            mask = mb.loss_mask.to(dev, torch.float32)
            old = old_values[k].to(dev, torch.float32)
            ret = returns[k].to(dev, torch.float32)
            loss, _ = ppo_value_loss(vals, old, ret, mask, **kw)
            losses.append(loss.detach())
            records.append((vals.detach().cpu(), old.cpu(), ret.cpu(), mask.cpu()))
            return loss * scale

        self.model.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(mbs, value_microbatch, forward_only=False)
        finalize_model_grads([self.ddp], pg_collection=self.groups.pg_collection)
        skipped = not all_finite(losses, self.ddp, self.platform.device)
        if skipped:
            log.warning("non-finite value loss or critic gradient: this critic step is skipped on every rank")
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            grad_norm = float("nan")
        else:
            self.scheduler.step(1)  # LR of this step (the learner's convention)
            with self.platform.optimizer_context():
                _, grad_norm, _ = self.optimizer.step()
            if grad_norm is None:
                grad_norm = self.optimizer.get_grad_norm()
        metrics = {"critic/grad_norm": float(grad_norm),
                   "critic/lr": float(self.optimizer.param_groups[0]["lr"]),
                   "critic/skipped_nonfinite": float(skipped)}
        if self.groups.is_last_stage:
            metrics.update(_batch_metrics([r for part in self._gather_dp(records) for r in part], kw))
        return metrics

    # ----------------------------------------------------------------------------- checkpoints
    def state_for_checkpoint(self) -> dict:
        """This rank's optimizer and LR-scheduler state (the model goes through megatron
        ``dist_checkpointing``; see :mod:`megatron_rlhf.learner.checkpoint`)."""
        self._check_open()
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "lr": self.lr}

    def load(self, state: dict) -> None:
        """Restore what :meth:`state_for_checkpoint` returned (after the model was loaded)."""
        self._check_open()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Drop the model and optimizer (the process groups belong to the learner). Idempotent."""
        self._closed = True
        self.model = self.ddp = self.optimizer = self.scheduler = None


def _batch_metrics(records: list[tuple], kw: dict) -> dict[str, float]:
    """``ppo_value_loss`` metrics of the whole batch from per-micro-batch ``(values, old_values,
    returns, mask)`` records (rows right-padded to the longest micro-batch with mask 0)."""
    if not records:
        return {}
    s = max(r[0].shape[1] for r in records)

    def cat(i):
        return torch.cat([torch.nn.functional.pad(r[i], (0, s - r[i].shape[1])) for r in records])

    _, m = ppo_value_loss(cat(0), cat(1), cat(2), cat(3), **kw)
    return {k: float(v) for k, v in m.items()}
