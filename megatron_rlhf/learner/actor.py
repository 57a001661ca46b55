"""The Megatron learner: policy + frozen reference GPTModel, megatron DDP and optimizer, and every
loss of :mod:`megatron_rlhf.losses` (``algorithm.loss``; a PPO critic in
:mod:`megatron_rlhf.learner.critic`).

One instance per learner process (rank). With ``learner.tensor_parallel * pipeline_parallel *
data_parallel == 1`` it is a complete learner by itself (the trainer may run it as one Ray actor);
larger layouts run one instance per rank (``rank``, ``world_size``, ``init_method``) and every
public verb is then *collective*: all ranks call it together, with the same arguments
(:class:`megatron_rlhf.learner.group.LearnerGroup` does the fan-out). Results that only exist
at the end of the pipeline (logprobs, loss metrics) are returned by the last-stage ranks; other
ranks return None (logprobs) or the rank-independent metrics (``grad/norm``, ``lr``).

Parallel layout (megatron-core 0.16.1; process groups passed explicitly through a
``ProcessGroupCollection``, never read from ``parallel_state`` here):

* TP: Megatron column/row-parallel layers; the vocab is padded to a multiple of TP
  (:func:`megatron_rlhf.convert.sharding.padded_vocab_size`) and padded logits are masked out;
  logprobs use vocab-parallel cross entropy (:mod:`megatron_rlhf.learner.schedule`); sequence
  parallelism when ``learner.sequence_parallel`` and TP > 1.
* PP: ``get_forward_backward_func`` with variable-length micro-batches; tied embeddings' grads
  are reduced over the embedding group by megatron's ``finalize_model_grads``.
* DP: megatron DDP (fp32 grad buffers, averaged in the collective) and ``get_megatron_optimizer``
  (``learner.distributed_optimizer`` shards the fp32 master weights and Adam state over DP);
  units (pairs, groups or rows) are dealt to DP ranks by length (:mod:`megatron_rlhf.learner.batching`).
* Model config and layer spec: :func:`megatron_rlhf.learner.model.learner_model_spec` of the
  platform facts (CUDA, Transformer Engine), so a CPU test builds the GPU variant. GPU only: the
  Transformer Engine spec, fused SwiGLU, TE fused RoPE, grad-reduce overlap (DP > 1), bf16
  params with fp32 master weights. Micro-batch lengths are rounded to
  ``learner.seq_length_multiple`` (GPU default 64; :func:`megatron_rlhf.platform.micro_batch_length_multiple`).

Per batch (``train_step``; per-loss glue in :mod:`megatron_rlhf.learner.objectives`):

1. Check ``batch.unit`` against ``algorithm.loss`` (``pair`` for online_dpo, ``group`` for
   group_dpo / grpo / ppo / rloo / proximal_rloo, ``best`` for best_of_k_sft).
2. Micro-batches of ``learner.micro_batch_size`` rows, or of at most
   ``learner.max_tokens_per_microbatch`` token slots, sorted by length; a pair (online_dpo) or
   a prompt group (group_dpo) stays in one micro-batch, other losses' rows are independent (their
   advantages are computed over the whole batch first); units are dealt over DP ranks.
3. Reference token logprobs, forward only (every loss: DPO log-ratios, the GRPO KL term, the KL
   in the PPO / RLOO reward, and the ``kl/ref_*`` metrics).
4. pi_old token logprobs: a forward-only recompute by the policy before the first update when
   ``updates_per_batch`` T > 1 or when the KL enters the reward (ppo / rloo / proximal_rloo with
   ``kl_beta > 0``); otherwise, with T = 1, the detached logprobs of the update's own forward (the
   same weights on the same tokens: the ratio is exactly 1 and the clip inactive).
5. Temperature: policy-gradient losses (grpo, ppo, rloo, proximal_rloo) use logprobs of
   ``softmax(logits / temperature)`` for the current policy, pi_old and the reference: the
   distribution the generators sampled from (as verl and OpenRLHF do); DPO and SFT losses use 1.
6. The batch transform on the last pipeline stage, over the whole batch (all DP ranks' rows):
   GRPO / RLOO / PPO advantages (PPO with the critic's old values), GroupDPO pair count.
7. T optimizer steps on the batch, each a forward/backward over all micro-batches with loss
   ``sum_k loss_k * DP * n_mb`` where ``loss_k`` uses the whole batch's denominators (sequences,
   tokens, pairs over all DP ranks): megatron divides each micro-batch loss by ``n_mb`` and DDP
   averages over DP, so the gradient equals that of the whole-batch loss on one process. The
   LR scheduler steps once per optimizer step (schedule length ``total_steps * T``); PPO's
   critic also takes T steps. ``entropy_coef > 0`` adds the policy's per-token entropy
   (vocab-parallel, with grad).
8. ``weight_version += 1``; every ``learner.ref_sync_interval`` batches the reference is reset to
   the policy (Lanchantin et al. 2025).
9. Metrics: the loss function called once more on the gathered whole batch (detached), so they
   do not depend on micro-batching or DP (see :meth:`MegatronLearner.train_step`).

Online DPO: Guo et al. 2024; Noukhovitch et al. 2024, sec. 2. GroupDPO: Lanchantin et al. 2025,
eq. 4. GRPO: Shao et al. 2024, eq. 3. PPO: Schulman et al. 2017, Ouyang et al. 2022. RLOO and
proximal RLOO: Ahmadian et al. 2024; Noukhovitch et al. 2024, App. B.
"""

from __future__ import annotations

import logging
import random
import shutil
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig
from megatron_rlhf.convert.mapping import torch_dtype
from megatron_rlhf.convert.sharding import padded_vocab_size
from megatron_rlhf.learner import parallel
from megatron_rlhf.learner.batching import padding_fraction, plan_microbatches, row_lengths
from megatron_rlhf.learner.checkpoint import load_learner_checkpoint, save_learner_checkpoint
from megatron_rlhf.learner.logprobs import masked_sum as _masked_sum
from megatron_rlhf.learner.model import (build_gpt_model, check_divisible, learner_model_spec,
                                         load_hf_config)
from megatron_rlhf.learner.optim import all_finite, build_train_state
from megatron_rlhf.learner.objectives import (BatchTensors, LossSpec, SliceInputs, assemble,
                                              check_batch, loss_on_slice, microbatch_inputs,
                                              prepare_batch, whole_batch_metrics)
from megatron_rlhf.learner.schedule import cut_rows, make_microbatch, run_microbatches
from megatron_rlhf.learner.weights import (buckets, finalize_hf_folder, iter_stage_hf_tensors,
                                           load_hf_weights, mark_tensor_parallel, prepare_hf_dir,
                                           stage_hf_entries, write_hf_shards)
from megatron_rlhf.platform import get_platform, micro_batch_length_multiple
from megatron_rlhf.runtime import pin_to_core
from megatron_rlhf.types import LearnerBatch

__all__ = ["MegatronLearner"]

log = logging.getLogger(__name__)


def _on_device(x: SliceInputs, device) -> SliceInputs:
    """A copy of ``x`` with its tensors on ``device``."""
    return replace(x, **{f.name: getattr(x, f.name).to(device) for f in fields(x)
                         if torch.is_tensor(getattr(x, f.name))})


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` token logprobs and 0/1 mask -> ``[B]`` float32 row sums, accumulated in float64
    so that the same token values give the same sum whatever the row's padded length (the
    association of a float32 reduction depends on it: 1 ulp is ~8e-6 at |sum| ~ 100)."""
    return _masked_sum(values.double(), mask.to(values.device).double()).float()


class MegatronLearner:
    """Policy and reference megatron GPTModels plus optimizer state, trained with ``algorithm.loss``.

    Args:
        model_dir: HF model folder (config, safetensors, tokenizer) the policy and the reference
            start from (each rank reads only its own shards).
        learner_cfg: ``LearnerConfig`` (parallel sizes, ``micro_batch_size``, ``optimizer``,
            ``ref_sync_interval``, ``distributed_optimizer``, ``sequence_parallel``, ``recompute``).
        algorithm_cfg: ``AlgorithmConfig`` (``loss`` and its knobs, ``updates_per_batch``).
        dtype: parameter dtype (``float32`` on CPU; ``bfloat16`` on GPU trains with fp32 master
            weights).
        seed: seeds torch and megatron's RNG tracker.
        total_steps: learner batches of the run; the LR schedule spans ``total_steps *
            algorithm.updates_per_batch`` optimizer steps (stored as ``self.total_steps``).
        cpu_core: pin this process to that core (-1: no pinning).
        rank, world_size: this process in the learner group; ``world_size`` defaults to
            ``tensor_parallel * pipeline_parallel * data_parallel``.
        init_method: torch.distributed rendezvous (``tcp://HOST:PORT``); required when
            ``world_size > 1`` (None: a free loopback port, world size 1 only).
        temperature: the generators' sampling temperature (``generators.temperature``); the
            policy-gradient losses train on logprobs of ``logits / temperature``.
    Raises:
        ValueError: ``world_size`` differs from the configured layout, the model cannot be
            split (heads / query groups / FFN not divisible by TP, layers not by PP), or
            ``learner.recompute`` modules the platform refuses, or ``temperature <= 0``.
    Attributes:
        weight_version: number of batches trained (restored by ``load_checkpoint``).
        critic: the PPO critic (``algorithm.loss=ppo``), else None.
    """

    def __init__(self, *, model_dir: str, learner_cfg: LearnerConfig, algorithm_cfg: AlgorithmConfig,
                 dtype: str = "float32", seed: int = 0, total_steps: int = 1, cpu_core: int = -1,
                 rank: int = 0, world_size: int | None = None, init_method: str | None = None,
                 temperature: float = 1.0):
        t0 = time.perf_counter()
        if not temperature > 0:
            raise ValueError(f"MegatronLearner: temperature={temperature} (generators.temperature) "
                             "must be > 0")
        tp, pp, dp = learner_cfg.tensor_parallel, learner_cfg.pipeline_parallel, learner_cfg.data_parallel
        world_size = tp * pp * dp if world_size is None else int(world_size)
        if world_size != tp * pp * dp:
            raise ValueError(f"MegatronLearner: world_size={world_size} but learner.tensor_parallel*"
                             f"pipeline_parallel*data_parallel = {tp}*{pp}*{dp} = {tp * pp * dp}")
        pin_to_core(cpu_core)
        self.model_dir = str(model_dir)
        self.cfg, self.algo = learner_cfg, algorithm_cfg
        self.spec = LossSpec.of(algorithm_cfg)
        self.temperature = float(temperature)
        self.dtype = torch_dtype(dtype)
        self.total_steps = int(total_steps) * algorithm_cfg.updates_per_batch  # optimizer steps
        self.platform = get_platform()
        # the global CUDA->CPU function mode is only needed by pipeline schedules (PP > 1)
        self.platform.install(function_mode=pp > 1)
        self.platform.select_local_device()
        self.groups = parallel.acquire(backend=self.platform.dist_backend, tp=tp, pp=pp, rank=rank,
                                       world_size=world_size, init_method=init_method)
        self._closed = False
        self._ckpt_writer = None   # learner.checkpoint.AsyncCheckpointWriter, on the first async save
        pg = self.groups.pg_collection
        self.tp_rank, self.pp_rank, self.dp_rank = pg.tp.rank(), pg.pp.rank(), pg.dp.rank()
        self.platform.seed(seed)
        self.hf_config = load_hf_config(model_dir)
        self._check_divisible()
        self.vocab_size = int(self.hf_config.vocab_size)
        self.padded_vocab = padded_vocab_size(self.vocab_size, tp)
        self.model_spec = learner_model_spec(self.hf_config, learner_cfg, dtype=self.dtype,
                                             cuda=not self.platform.is_cpu,
                                             te=self.platform.transformer_engine,
                                             wgrad_kernel=self.platform.fused_wgrad_kernel)
        self.sequence_parallel = self.model_spec.sequence_parallel
        self.tconfig = self.model_spec.config
        self.policy = self._build()
        self.reference = self._build()
        self.reference.requires_grad_(False).eval()
        self.ddp, self.optimizer, self.scheduler = self._build_optimizer()
        self.critic = self._build_critic() if algorithm_cfg.loss == "ppo" else None
        self.weight_version = 0
        self.reference_version = 0   # weight version the reference equals (0: the starting weights)
        # one line per rank naming what was built (review 2, N11): the layer spec (TE's layer spec,
        # or the local block spec) and its core attention, and the optimizer (megatron's wrapper and
        # the torch/TE/Apex optimizer inside: "falling back to torch optimizers" shows here)
        sm = self.model_spec.layer_spec.submodules
        layer = (sm.layer_specs[0] if hasattr(sm, "layer_specs") else self.model_spec.layer_spec).submodules
        inner = getattr(self.optimizer, "optimizer", None) or next(
            iter(getattr(self.optimizer, "chained_optimizers", None) or []), None)
        inner = getattr(inner, "optimizer", inner)
        log.info("MegatronLearner rank %d/%d (tp %d, pp %d, dp %d) ready in %.1f s (%s, %d local params; "
                 "spec %s, core attention %s, gradient_accumulation_fusion %s; optimizer %s(%s))",
                 self.groups.rank, world_size, self.tp_rank, self.pp_rank, self.dp_rank,
                 time.perf_counter() - t0, self.hf_config.model_type,
                 sum(p.numel() for p in self.policy.parameters()),
                 "transformer_engine" if self.platform.transformer_engine else "local",
                 getattr(layer.self_attention.submodules.core_attention, "__name__", "?"),
                 self.tconfig.gradient_accumulation_fusion, type(self.optimizer).__name__, type(inner).__name__ if inner is not None else "-")

    # ----------------------------------------------------------------------------- building
    def _check_divisible(self) -> None:
        check_divisible(self.hf_config, tensor_parallel=self.cfg.tensor_parallel,
                        pipeline_parallel=self.cfg.pipeline_parallel)

    def _build(self):
        model = build_gpt_model(self.hf_config, self.tconfig, platform=self.platform,
                                pg_collection=self.groups.pg_collection,
                                pre_process=self.groups.is_first_stage,
                                post_process=self.groups.is_last_stage,
                                vocab_size=self.padded_vocab, layer_spec=self.model_spec.layer_spec)
        mark_tensor_parallel(model, self.hf_config)  # before DDP/optimizer read the attributes
        load_hf_weights(model, self.model_dir, self.hf_config, tp_rank=self.tp_rank,
                        tp=self.groups.tp, padded_vocab=self.padded_vocab)
        return model

    def _build_optimizer(self):
        """Megatron DDP, optimizer and LR scheduler of the policy (:mod:`megatron_rlhf.learner.optim`;
        schedule in :meth:`_lr_schedule_args`)."""
        st = build_train_state(module=self.policy, tconfig=self.tconfig, groups=self.groups,
                               platform=self.platform, optimizer_cfg=self.cfg.optimizer, dtype=self.dtype,
                               distributed_optimizer=self.cfg.distributed_optimizer,
                               schedule_args=self._lr_schedule_args())
        self.overlap_grad_reduce, self.use_distributed_optimizer = st.overlap_grad_reduce, st.use_distributed_optimizer
        return st.ddp, st.optimizer, st.scheduler

    def _build_critic(self):
        """The PPO critic (:class:`megatron_rlhf.learner.critic.Critic`), built from this learner's
        layout, config and ``total_steps`` (optimizer steps)."""
        from megatron_rlhf.learner.critic import Critic

        return Critic(self)

    @property
    def _loss_temperature(self) -> float:
        """Temperature of the learner's logprobs in training: the generators' sampling temperature
        for policy-gradient losses (ratios and TIS against the distribution vLLM sampled from),
        1 for the DPO and SFT losses (their likelihoods are of the model itself)."""
        return self.temperature if self.spec.temperature_applies else 1.0

    def _lr_schedule_args(self) -> dict:
        """LR of optimizer step k (1-based): warmup ``lr * k / W`` for k <= W, then
        constant / linear / cosine from ``lr`` towards ``min_lr``, reaching ``min_lr`` one step
        after ``total_steps`` (so no step trains with LR 0). The scheduler is advanced *before*
        each optimizer step (megatron's ``OptimizerParamScheduler.get_lr`` with num_steps = k)."""
        o = self.cfg.optimizer
        decay_steps = max(self.total_steps, o.warmup_steps) + 1
        return dict(init_lr=0.0, max_lr=o.lr, min_lr=min(o.min_lr, o.lr),
                    lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps,
                    lr_decay_style=o.lr_decay, start_wd=o.weight_decay, end_wd=o.weight_decay,
                    wd_incr_steps=decay_steps, wd_incr_style="constant",
                    use_checkpoint_opt_param_scheduler=True)

    def _model(self, which: str):
        if which not in ("policy", "reference"):
            raise ValueError(f"which={which!r}: expected 'policy' or 'reference'")
        if self._closed:
            raise RuntimeError("MegatronLearner is closed")
        return self.policy if which == "policy" else self.reference

    # ----------------------------------------------------------------------------- layout
    def layout(self) -> dict:
        """This rank's coordinates: ``rank, world_size, tp, pp, dp`` (sizes), ``tp_rank, pp_rank,
        dp_rank``, ``is_last_stage``, ``vocab_size``, ``padded_vocab``, ``sequence_parallel``."""
        g = self.groups
        return {"rank": g.rank, "world_size": g.world_size, "tp": g.tp, "pp": g.pp, "dp": g.dp,
                "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
                "is_last_stage": g.is_last_stage, "vocab_size": self.vocab_size,
                "padded_vocab": self.padded_vocab, "sequence_parallel": self.sequence_parallel}

    def _pad_multiple(self) -> int:
        return micro_batch_length_multiple(self.cfg.seq_length_multiple, cuda=not self.platform.is_cpu,
                                           tp=self.groups.tp, sequence_parallel=self.sequence_parallel)

    def _plans(self, lengths: list[int], units: list[int] | None = None):
        """Every DP rank's micro-batches; ``units``: sizes of consecutive units kept together
        (None: rows are independent); packed ones with ``learner.pack_sequences``."""
        return [plan_microbatches(lengths, rows_per_microbatch=self.cfg.micro_batch_size,
                                  dp_rank=d, dp_size=self.groups.dp, pairs=False,
                                  pad_multiple=self._pad_multiple(), units=units,
                                  max_tokens=self.cfg.max_tokens_per_microbatch,
                                  packed=self.cfg.pack_sequences)
                for d in range(self.groups.dp)]

    def _microbatches(self, ids, plan, lengths, loss_mask=None, **extra) -> list:
        """The tensors of this rank's planned micro-batches (packed with ``learner.pack_sequences``)."""
        pad = self._pad_multiple()
        return [make_microbatch(ids, mb.rows, mb.seq_len, self.platform.device, loss_mask=loss_mask,
                                pack_lengths=[lengths[r] for r in mb.rows] if mb.packed_len else None,
                                pad_multiple=pad, **extra)
                for mb in plan]

    def _gather_dp(self, obj) -> list:
        """``obj`` of every DP rank of this (TP rank, PP stage), in DP rank order."""
        return parallel.gather_dp(self.groups, obj)

    def _run(self, model, mbs, on_logprobs, *, forward_only: bool, temperature: float = 1.0,
             with_entropy: bool = False) -> None:
        run_microbatches(model, mbs, on_logprobs, forward_only=forward_only, pp=self.groups.pp,
                         pg_collection=self.groups.pg_collection, vocab_size=self.vocab_size,
                         padded_vocab=self.padded_vocab, tp_rank=self.tp_rank, tp=self.groups.tp,
                         no_sync=self.ddp.no_sync if self.overlap_grad_reduce and not forward_only else None,
                         temperature=temperature, with_entropy=with_entropy)

    def _forward_token_logprobs(self, model, mbs, temperature: float = 1.0) -> list:
        """Forward-only pass over ``mbs``; on the last stage ``[b_k, s_k]`` CPU token logprobs (of
        ``softmax(logits / temperature)``) per micro-batch, elsewhere ``[]``."""
        out = [None] * len(mbs)

        def keep(k, mb, tok):
            out[k] = tok.detach().float().cpu()

        if mbs:
            was_training = model.training
            model.eval()
            try:
                self._run(model, mbs, keep, forward_only=True, temperature=temperature)
            finally:
                model.train(was_training)
        return out if self.groups.is_last_stage else []

    # ----------------------------------------------------------------------------- logprobs
    def token_logprobs(self, input_ids, which: str = "policy", temperature: float = 1.0
                       ) -> torch.Tensor | None:
        """Teacher-forced token logprobs (rows dealt over DP, micro-batches of ``micro_batch_size``).

        Args:
            input_ids: ``[B, S]`` int64 (right-padded) tensor or nested list.
            which: ``policy`` or ``reference``.
            temperature: logprobs of ``softmax(logits / temperature)`` (the distribution a
                generator samples from at that temperature; > 0).
        Returns:
            on last-stage ranks ``[B, S]`` float32 CPU tensor: column t = log p(x_t | x_<t)
            (nats), column 0 = 0; None on other pipeline stages.
        """
        model = self._model(which)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        b, s = ids.shape
        lengths = row_lengths(None, s, b)
        mbs = self._microbatches(ids, self._plans(lengths)[self.dp_rank], lengths)
        toks = self._forward_token_logprobs(model, mbs, temperature=temperature)
        if not self.groups.is_last_stage:
            return None
        out = torch.zeros(b, s)
        for part in self._gather_dp([(mb.rows, t[:, :s]) for mb, t in zip(mbs, toks)]):
            for rows, t in part:
                out[list(rows)] = t
        return out

    def sequence_logprobs(self, input_ids, loss_mask, which: str = "policy",
                          temperature: float = 1.0) -> torch.Tensor | None:
        """Sum of token logprobs over positions with ``loss_mask`` = 1, each row cut to its real
        length (:mod:`~megatron_rlhf.learner.batching`).

        Args:
            input_ids, loss_mask: ``[B, S]`` (mask as in ``LearnerBatch``: 1 on completion tokens).
            which: ``policy`` or ``reference``.
            temperature: as in :meth:`token_logprobs`.
        Returns:
            ``[B]`` float32 (nats) on last-stage ranks; None on other pipeline stages.
        """
        model = self._model(which)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        mask = torch.as_tensor(loss_mask, dtype=torch.float32)
        b, s = ids.shape
        lengths = row_lengths(mask, s, b)
        mbs = self._microbatches(ids, self._plans(lengths)[self.dp_rank], lengths, loss_mask=mask)
        toks = self._forward_token_logprobs(model, mbs, temperature=temperature)
        if not self.groups.is_last_stage:
            return None
        out = torch.zeros(b)
        for part in self._gather_dp([(mb.rows, masked_sum(t, mb.loss_mask)) for mb, t in zip(mbs, toks)]):
            for rows, v in part:
                out[list(rows)] = v
        return out

    def reference_logprobs(self, input_ids, loss_mask, temperature: float = 1.0) -> dict | None:
        """The reference's token logprobs of completions, for the eval's KL on fresh samples
        (``eval.kl_ref``, :mod:`megatron_rlhf.trainer.evaluate`): the forward-only reference pass
        of :meth:`train_step`'s step 3, each row cut to its real length.

        Args:
            input_ids, loss_mask: ``[B, S]`` (right-padded; mask 1 on completion tokens).
            temperature: as in :meth:`token_logprobs` (the eval's sampling temperature).
        Returns:
            on last-stage ranks ``{"logprobs": [B, S] float32 CPU (nats; 0 beyond each row's last
            masked position), "reference_version": the weight version the reference equals}``;
            None on other pipeline stages.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        mask = torch.as_tensor(loss_mask, dtype=torch.float32)
        b, s = ids.shape
        lengths = row_lengths(mask, s, b)
        mbs = self._microbatches(ids, self._plans(lengths)[self.dp_rank], lengths, loss_mask=mask)
        toks = self._forward_token_logprobs(self.reference, mbs, temperature=temperature)
        if not self.groups.is_last_stage:
            return None
        out = self._full(mbs, toks, b, s)
        out[torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]] = 0.0   # padding: packed or not
        return {"logprobs": out, "reference_version": int(self.reference_version)}

    # ----------------------------------------------------------------------------- training
    def train_step(self, batch: LearnerBatch) -> dict[str, float]:
        """Train on one learner batch with ``algorithm.loss``: ``updates_per_batch`` (T) optimizer
        steps, then ``weight_version += 1`` (see the module doc for the order of passes).

        Args:
            batch: ``input_ids``/``loss_mask``/``sampling_logprobs`` ``[B, S]``. Its ``unit`` must be
                ``algorithm.loss``'s (batches without ``group_ids``
                are ``pair`` batches: rows 2i / 2i+1 are pair i's chosen / rejected). Group and
                best batches carry ``rewards [B]`` and ``group_ids [B]`` (a group's rows adjacent).
        Returns:
            float metrics. Every rank: ``grad/norm`` (global, before clipping, of the last update;
            NaN when skipped), ``lr`` (of the last update), ``train/update_ok`` (all T updates
            applied), ``train/skipped_nonfinite`` (1.0 when an update was skipped because the
            loss or a gradient was not finite on some rank: every rank skipped it, no optimizer
            or LR-scheduler step, and the batch's remaining updates and critic step too),
            ``train/updates`` (T), ``train/num_units`` (prompts), ``train/num_sequences`` (B),
            ``train/num_pairs`` (pair batches), ``train/tokens`` (completion tokens),
            ``train/microbatches`` (per update, all DP ranks), ``batch/padding_fraction``
            (padded slots / all slots the micro-batches ran), ``batch/padding_fraction_unsorted``
            (the same for the ``[B, S]`` batch as given), ``ref/synced`` (1.0 when the reference
            was reset to the policy after this batch), ``time/train_s``, ``time/ref_s`` (reference
            pass), ``time/old_s`` (pi_old recompute, when it runs), ``perf/learner_tokens_per_s``
            (real tokens of the batch per second of ``time/train_s``, all ranks; ``..._per_rank``),
            ``perf/learner_tflops`` (model TFLOP/s, ``learner/flops.py``; ``..._per_rank``) and
            ``perf/mfu`` where the device's peak is known (``learner.peak_tflops`` or
            ``platform/peaks.py``; not on CPU). Last-stage ranks add, over the
            whole batch (independent of micro-batching and DP): the loss function's own metrics
            (``loss/*``, ``dpo/*``, ``pg/*``, ``adv/*``, ``tis/*``, ``entropy/mean``, ...; for T > 1
            those of the LAST update's forward, plus ``loss/total_first_update``), the batch
            transform's (``reward/*``, ``ppo/*``), and, from the FIRST update's forward (the
            weights before this batch): ``kl/ref_k3`` and ``kl/ref_k1`` (approximate KL of the
            policy to the reference over completion tokens, k3 and k1 estimators of Schulman
            2020), ``logprobs/vllm_gap_abs_mean``, ``logprobs/vllm_gap_abs_max`` and
            ``logprobs/token_mult_prob_error`` (NeMo-RL's mean over tokens of
            exp(|learner - generator| token logprob)), all at the generators' sampling
            temperature (the DPO / SFT losses train at temperature 1, so for them, at a sampling
            temperature != 1, an extra forward-only pass gives the learner's logprobs at the
            sampling temperature: ``time/mismatch_s``); and
            ``rollout/entropy_mc`` (mean of -sampling logprob over completion tokens: a
            Monte-Carlo estimate of the rollouts' token entropy). The last three skip tokens with
            a non-finite generator logprob and are NaN without ``sampling_logprobs``. ppo adds
            the critic's ``value/*``, ``critic/grad_norm``, ``critic/lr``,
            ``critic/skipped_nonfinite`` (1.0 when the critic's value loss or gradient was not
            finite on some rank: every rank skipped the critic step, and the batch's remaining
            critic steps; the policy update stands) and ``loss/value`` (``value_coef *
            value/loss``, also added to ``loss/total``).
        Raises:
            ValueError: the batch's unit differs from ``algorithm.loss``'s, mismatched shapes,
                an odd pair batch, missing rewards / group_ids, non-adjacent group rows, or fewer
                units than DP ranks.
        """
        t0 = time.perf_counter()
        x = check_batch(batch, self.algo, data_parallel=self.groups.dp)
        b, s = x.ids.shape
        lengths = row_lengths(x.mask, s, b)
        plans = self._plans(lengths, units=x.units)
        extra = {} if x.slp is None else {"slp": x.slp}
        mbs = self._microbatches(x.ids, plans[self.dp_rank], lengths, loss_mask=x.mask, **extra)
        times: dict[str, float] = {}
        full, prep, inputs, old_values = self._before_updates(x, mbs, times)
        oks, first, records, critic_metrics, skipped = [], None, None, {}, False
        for update in range(self.algo.updates_per_batch):
            ok, grad_norm, records, skipped = self._update(mbs, inputs, prep)
            oks.append(ok)
            first = records if update == 0 else first
            if skipped:   # the same weights on the same batch would fail again
                break
            if self.critic is not None and not critic_metrics.get("critic/skipped_nonfinite"):
                critic_metrics = self._critic_step(x, mbs, old_values, prep)   # (a skipped one would fail again)
        self.weight_version += 1
        r = self.cfg.ref_sync_interval
        synced = bool(r) and self.weight_version % r == 0
        if synced:
            self.sync_reference()
        metrics = {"grad/norm": float(grad_norm), "lr": self._lr(), "train/update_ok": float(all(oks)),
                   "train/skipped_nonfinite": float(skipped),
                   "train/updates": float(self.algo.updates_per_batch),
                   "train/num_units": float(x.num_units), "train/num_sequences": float(b),
                   "train/tokens": float(x.mask.sum()),
                   "train/microbatches": float(sum(len(p) for p in plans)),
                   "batch/padding_fraction": padding_fraction(lengths, plans),
                   "batch/padding_fraction_unsorted": 1.0 - sum(lengths) / float(b * s),
                   "ref/synced": float(synced), **times}
        if x.unit == "pair":
            metrics["train/num_pairs"] = float(b // 2)
        if self.groups.is_last_stage:
            metrics.update(self._batch_metrics(x, prep, full, first, records))
        if critic_metrics:
            metrics.update(critic_metrics)
            if "value/loss" in critic_metrics:
                metrics["loss/value"] = self.algo.value_coef * float(critic_metrics["value/loss"])
                if "loss/total" in metrics:
                    metrics["loss/total"] += metrics["loss/value"]
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics.update(self._throughput(lengths, len(oks), times, metrics["time/train_s"]))
        return metrics

    def _throughput(self, lengths: list[int], updates: int, times: dict, seconds: float) -> dict[str, float]:
        """``perf/*`` of this step (:func:`~megatron_rlhf.learner.flops.throughput_metrics`): model
        FLOPs of the policy's and reference's passes (3 per update, 1 per forward-only pass; the
        PPO critic's are not counted) over the rows' real lengths, in this rank's step time."""
        from megatron_rlhf.learner.flops import throughput_metrics
        from megatron_rlhf.platform.peaks import device_peak_tflops

        passes = 3 * updates + 1 + ("time/old_s" in times) + ("time/mismatch_s" in times)
        peak = device_peak_tflops(self.platform.device, self.dtype, self.cfg.peak_tflops)
        return throughput_metrics(self.hf_config, lengths, passes, seconds, self.groups.world_size, peak)

    def _before_updates(self, x: BatchTensors, mbs, times: dict):
        """Forward-only passes and the batch transform (module doc, steps 3-6): reference (and
        pi_old, critic) token values per micro-batch, gathered over DP into ``[B, S]`` tensors on
        the last stage, :func:`prepare_batch`, and each micro-batch's loss inputs.

        Returns:
            ``(full, prep, inputs, old_values)``: ``full`` the ``[B, S]`` tensors (``ref``, ``old``,
            ``values``), ``prep`` the :class:`~megatron_rlhf.learner.objectives.Prepared`,
            ``inputs`` one CPU ``SliceInputs`` per micro-batch (``full``, ``prep`` None and
            ``inputs`` empty on other pipeline stages), ``old_values`` the critic's per-micro-batch
            values (ppo) or None.
        """
        b, s = x.ids.shape
        temp = self._loss_temperature
        t1 = time.perf_counter()
        ref = self._forward_token_logprobs(self.reference, mbs, temperature=temp)
        times["time/ref_s"] = time.perf_counter() - t1
        old = None
        if self.spec.recompute_old:
            t1 = time.perf_counter()
            old = self._forward_token_logprobs(self.policy, mbs, temperature=temp)
            times["time/old_s"] = time.perf_counter() - t1
        at_t = None
        if x.slp is not None and temp != self.temperature:   # mismatch metric: like with like
            t1 = time.perf_counter()
            at_t = self._forward_token_logprobs(self.policy, mbs, temperature=self.temperature)
            times["time/mismatch_s"] = time.perf_counter() - t1
        old_values = self.critic.values(mbs) if self.critic is not None else None
        if not self.groups.is_last_stage:
            return None, None, [], old_values
        full = {"ref": self._full(mbs, ref, b, s)}
        if at_t is not None:
            full["at_sampling_temperature"] = self._full(mbs, at_t, b, s)
        if old is not None:
            full["old"] = self._full(mbs, old, b, s)
        if old_values is not None:
            full["values"] = self._full(mbs, old_values, b, s)
        prep = prepare_batch(self.algo, mask=x.mask, rewards=x.rewards, group_ids=x.group_ids,
                             ref_logprobs=full["ref"], old_logprobs=full.get("old"),
                             old_values=full.get("values"))
        inputs = [microbatch_inputs(mb.rows, mb.input_ids.shape[1], mb.loss_mask, x, prep, ref[k],
                                    None if old is None else old[k], mb.extra.get("slp"))
                  for k, mb in enumerate(mbs)]
        return full, prep, inputs, old_values

    def _update(self, mbs, inputs: list[SliceInputs], prep) -> tuple[bool, float, list, bool]:
        """One optimizer step on the batch: forward/backward of every micro-batch with loss
        ``loss_k * DP * len(mbs)`` (module doc, step 7), grad finalisation, LR step, Adam step.
        When any rank's loss or gradient is not finite (``optim.all_finite``, collective) every
        rank zeroes its gradients and skips the LR and optimizer steps.

        Returns:
            ``(update applied, global grad norm before clipping, records, skipped as non-finite)``;
            ``records`` (last stage only) holds ``(rows, token logprobs, entropy or None)`` CPU
            copies per micro-batch.
        """
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        spec, records, losses = self.spec, [], []
        scale = self.groups.dp * len(mbs)  # megatron divides by len(mbs), DDP averages over DP

        def loss_fn(k, mb, tok, ent=None):
            sl = _on_device(inputs[k], tok.device)
            sl.logprobs, sl.entropy = tok, ent
            if spec.uses_old and sl.old_logprobs is None:  # T = 1: pi_old is this very forward
                sl.old_logprobs = tok.detach()
            loss, _ = loss_on_slice(self.algo, sl, prep.totals)
            losses.append(loss.detach())
            records.append((mb.rows, tok.detach().float().cpu(),
                            None if ent is None else ent.detach().float().cpu()))
            return loss * scale

        self.policy.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self.ddp, mbs, loss_fn, forward_only=False, temperature=self._loss_temperature,
                  with_entropy=spec.uses_entropy)
        finalize_model_grads([self.ddp], pg_collection=self.groups.pg_collection)
        if not all_finite(losses, self.ddp, self.platform.device):
            log.warning("non-finite loss or gradient: this update is skipped on every rank")
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            return False, float("nan"), records, True
        self.scheduler.step(1)  # LR of this optimizer step (see _lr_schedule_args)
        with self.platform.optimizer_context():
            ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:
            grad_norm = self.optimizer.get_grad_norm()
        return bool(ok), float(grad_norm), records, False

    def _full(self, mbs, toks, b: int, s: int) -> torch.Tensor:
        """``[B, S]`` CPU tensor from this DP group's per-micro-batch ``[b_k, s_k]`` tensors ``toks``
        (rows of ``mbs``; collective over DP; columns beyond ``S`` are padding and dropped)."""
        return assemble(self._gather_dp([(mb.rows, t) for mb, t in zip(mbs, toks)]), b, s)

    def _batch_metrics(self, x: BatchTensors, prep, full: dict, first: list, last: list) -> dict[str, float]:
        """Whole-batch metrics (:func:`~megatron_rlhf.learner.objectives.whole_batch_metrics`) from
        every DP rank's records of the first and last update (collective over DP)."""
        b, s = x.ids.shape

        def tensor(parts, i):
            return assemble([[(rec[0], rec[i]) for rec in part] for part in parts], b, s)

        first_parts = self._gather_dp(first)
        last_parts = first_parts if last is first else self._gather_dp(last)
        return whole_batch_metrics(
            self.algo, x, prep, ref_logprobs=full["ref"], first_logprobs=tensor(first_parts, 1),
            last_logprobs=None if last is first else tensor(last_parts, 1),
            old_logprobs=full.get("old"),
            entropy=tensor(last_parts, 2) if self.spec.uses_entropy else None,
            sampling_temperature_logprobs=full.get("at_sampling_temperature"))

    def _critic_step(self, x: BatchTensors, mbs, old_values, prep) -> dict[str, float]:
        """One optimizer step of the PPO critic on the batch (collective). Old values and value
        targets are per micro-batch ``[b_k, s_k]``; on other pipeline stages (which compute no
        loss) zeros of that shape stand in for them."""
        if self.groups.is_last_stage:
            returns = [cut_rows(prep.returns, mb.rows, mb.input_ids.shape[1], 0.0) for mb in mbs]
        else:
            old_values = returns = [torch.zeros(tuple(mb.input_ids.shape)) for mb in mbs]
        return self.critic.train_step(mbs, old_values, returns, global_num_sequences=float(x.ids.shape[0]),
                                      global_num_tokens=float(x.mask.sum()),
                                      loss_agg=self.algo.loss_agg or "token_mean")

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ----------------------------------------------------------------------------- weights
    def _stage_hf_tensors(self, which: str = "policy", what: str = "param", device="cpu"):
        """This stage's full HF-named tensors (TP-gathered; yielded on TP rank 0 only), on
        ``device`` (None: the model's device, what the broadcast exporter packs from)."""
        tp_group = self.groups.pg_collection.tp if self.groups.tp > 1 else None
        return iter_stage_hf_tensors(self._model(which), self.hf_config, tp_group=tp_group, what=what,
                                     device=device)

    def _stage_hf_entries(self, which: str = "policy") -> list:
        """``(hf_name, dtype, shape, nbytes)`` of what :meth:`_stage_hf_tensors` yields, from
        metadata only (``weights.stage_hf_entries``: no gather; the broadcast layout's plan)."""
        return stage_hf_entries(self._model(which), self.hf_config, tp=self.groups.tp)

    def export_weights(self, bucket_bytes: int = 256 * 2**20) -> list[dict[str, torch.Tensor]]:
        """The policy as HF-named full tensors, grouped into buckets of at most ``bucket_bytes``
        (a tensor larger than that gets its own bucket). Collective over each TP group.

        Returns:
            list of ``{hf_name: tensor}``: contiguous CPU copies in the policy dtype, names/shapes
            exactly as in the HF checkpoint (tied ``lm_head.weight`` omitted). With one rank: the
            whole model. With several: this pipeline stage's tensors on its TP-rank-0 / DP-rank-0
            rank (HF order within the stage; stages concatenated in order give the HF order),
            ``[]`` on every other rank.
        """
        if self.dp_rank != 0:
            return []
        return list(buckets(self._stage_hf_tensors(), bucket_bytes))

    def export_weight_refs(self, bucket_bytes: int = 256 * 2**20) -> list:
        """Like :meth:`export_weights`, but each bucket goes into Ray's object store as soon as it
        is full (``ray.put``) and is dropped here, so this process never holds more than one
        bucket beyond its model shard. Must run inside Ray (a learner rank actor).

        Returns:
            list of ``ray.ObjectRef`` of ``dict[str, Tensor]`` buckets (``[]`` on ranks that do
            not export).
        """
        import ray

        if self.dp_rank != 0:
            return []
        return [ray.put(b) for b in buckets(self._stage_hf_tensors(), bucket_bytes)]

    def gradients_hf(self) -> dict[str, torch.Tensor]:
        """The policy's gradients of the last :meth:`train_step` as HF-named full CPU tensors of
        this pipeline stage (TP-gathered onto TP rank 0; ``{}`` on other TP ranks): megatron DDP's
        ``main_grad`` after the DP / sequence-parallel / tied-embedding reductions (and after
        the optimizer's global-norm clipping when ``clip_grad`` scaled them). For checking
        parallel layouts against one process; collective over the TP group.

        Raises:
            RuntimeError: with the distributed optimizer (each DP rank then holds only its
                reduce-scattered shard of the gradient buffer).
        """
        if self.use_distributed_optimizer:
            raise RuntimeError("gradients_hf: not available with learner.distributed_optimizer=true "
                               "(gradients are reduce-scattered over DP ranks)")
        return dict(self._stage_hf_tensors("policy", what="grad"))

    @torch.no_grad()
    def sync_reference(self) -> None:
        """Copy the policy's weights into the reference model (Lanchantin et al. 2025 ref sync).
        Local on every rank (both models share the layout)."""
        ref = dict(self.reference.named_parameters())
        for name, p in self.policy.named_parameters():
            ref[name].copy_(p)
        self.reference_version = self.weight_version

    def export_hf(self, out_dir: str, base_model_dir: str, max_shard_bytes: int = 5 * 10**9) -> None:
        """Write the policy as an HF folder: safetensors weights (``model.safetensors``, or
        ``model-0000k-of-0000n.safetensors`` + index when above ``max_shard_bytes``) plus every
        non-weight file of ``base_model_dir`` (config, tokenizer, chat template, generation
        config). Streaming: each pipeline stage's TP-rank-0 writes its own shard files one at a
        time; rank 0 renames them into HF order in a temporary sibling folder, then renames that
        to ``out_dir``. Collective over all ranks (needs a filesystem all ranks share).

        Raises:
            FileExistsError: ``out_dir`` exists and is not empty (raised on every rank, before any
                collective).
        """
        import torch.distributed as dist

        out = Path(out_dir)
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"export_hf: {out} exists and is not empty; pass a new folder")
        world = self.groups.world_size
        box = [str(prepare_hf_dir(out)) if self.groups.rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        shards = []
        if self.dp_rank == 0:
            try:
                shards = write_hf_shards(self._stage_hf_tensors(), tmp, f"stage{self.pp_rank:03d}",
                                         max_shard_bytes)
            except BaseException:
                if self.groups.rank == 0:   # no stray temporary folder (finalize_hf_folder's own on success)
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
        parts = [(self.pp_rank, shards)]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, (self.pp_rank, shards))
        if self.groups.rank == 0:
            ordered = [sh for _, stage in sorted(parts, key=lambda x: x[0]) for sh in stage]
            finalize_hf_folder(tmp, out, base_model_dir, ordered, dtype=self.dtype)
        if world > 1:
            dist.barrier()

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, reference_root: str | None = None, async_save: bool = False) -> None:
        """Save policy and reference (megatron ``dist_checkpointing``, torch_dist format, under
        ``path/policy`` and ``path/reference``: every rank writes its own shards; with
        ``reference_root`` the reference is saved once per reference version into
        ``reference_root/reference_vK`` and ``path/reference.json`` names it), the optimizer
        (with ``learner.distributed_optimizer``: its sharded state under ``path/policy_optimizer``,
        else in the state file), LR scheduler, RNG states and ``weight_version`` (``torch.save``:
        rank 0 to ``path/learner_state.pt``, rank r > 0 to ``path/learner_state.rank<r>.pt``).
        ``path`` is created. Collective over all ranks (:mod:`megatron_rlhf.learner.checkpoint`).

        With ``async_save`` the files are written by forked processes while this learner trains
        on; the checkpoint is complete once :meth:`finalize_checkpoint` says so (a pending earlier
        one is finalized first). What is written is the state at this call.
        """
        if async_save:
            from megatron_rlhf.learner.checkpoint import AsyncCheckpointWriter

            if self._ckpt_writer is None:
                self._ckpt_writer = AsyncCheckpointWriter()
            self._ckpt_writer.finalize(blocking=True)
            requests = save_learner_checkpoint(self, Path(path), None if reference_root is None
                                               else Path(reference_root), async_save=True)
            self._ckpt_writer.schedule(str(path), requests)
            return
        self.finalize_checkpoint(blocking=True)
        save_learner_checkpoint(self, Path(path),
                                None if reference_root is None else Path(reference_root))

    def finalize_checkpoint(self, blocking: bool = True) -> dict | None:
        """Complete the asynchronous save in flight, if its writers are done on every rank
        (collective; see :meth:`AsyncCheckpointWriter.finalize
        <megatron_rlhf.learner.checkpoint.AsyncCheckpointWriter.finalize>`).

        Returns:
            None (no save in flight), ``{"done": False, "path"}`` (still writing, ``blocking``
            false), or ``{"done": True, "path", "write_s", "write_start", "write_end"}``.
        Raises:
            RuntimeError / megatron ``CheckpointingException``: a writer failed.
        """
        return None if self._ckpt_writer is None else self._ckpt_writer.finalize(blocking=blocking)

    def load_checkpoint(self, path: str) -> int:
        """Restore everything :meth:`save_checkpoint` wrote; returns the restored weight_version.

        Raises:
            FileNotFoundError: ``path`` is not a complete learner checkpoint.
            ValueError: the checkpoint's layout cannot be resumed by this learner (a TP/PP
                change, a DP change without the distributed optimizer; see
                :func:`megatron_rlhf.learner.checkpoint.load_learner_checkpoint`).
        """
        self.weight_version = load_learner_checkpoint(self, Path(path))
        return self.weight_version

    # ----------------------------------------------------------------------------- lifecycle
    def get_weight_version(self) -> int:
        """Number of batches trained (same on every rank)."""
        return self.weight_version

    def close(self) -> None:
        """Free the models and release the process groups (the last learner in the process
        destroys megatron's parallel state and the gloo group). Idempotent."""
        if self._closed:
            return
        self._closed = True
        writer, self._ckpt_writer = getattr(self, "_ckpt_writer", None), None
        if writer is not None:   # a save in flight is written out before the groups go
            writer.close()
        critic, self.critic = getattr(self, "critic", None), None
        if critic is not None and hasattr(critic, "close"):
            critic.close()
        self.policy = self.reference = self.ddp = self.optimizer = self.scheduler = None
        parallel.release()

    def __del__(self):  # best effort; explicit close() is the contract
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    # RNG helpers used by checkpoint.py
    def _rng_state(self) -> dict:
        import numpy as np

        return {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(), "cuda": self.platform.device_rng_state()}

    def _set_rng_state(self, state: dict) -> None:
        import numpy as np

        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        self.platform.set_device_rng_state(state.get("cuda"))

