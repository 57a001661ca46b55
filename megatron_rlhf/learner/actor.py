"""The Megatron learner: policy + frozen reference GPTModel, megatron DDP and optimizer, Online DPO.

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
  pairs are dealt to DP ranks by length (:mod:`megatron_rlhf.learner.batching`).
* GPU only (never imported on CPU): the platform's Transformer Engine spec, fused SwiGLU, TE
  fused RoPE, grad-reduce overlap (DP > 1), bf16 params with fp32 master weights.

Per batch (``train_step``), Online DPO (Guo et al. 2024; Noukhovitch et al. 2024, sec. 2): rows
sorted by length into micro-batches of ``learner.micro_batch_size`` sequences (a pair's chosen and
rejected rows stay together), reference sequence logprobs (forward only), then the policy's
forward/backward with loss ``sum_{pairs i in micro-batch} dpo_loss_i * DP / P`` (megatron divides
by the number of micro-batches and DDP averages over DP, so the gradient equals that of the mean
DPO loss over all P pairs, exactly as on one process); one optimizer step; ``weight_version += 1``;
every ``learner.ref_sync_interval`` batches the reference is reset to the policy (Lanchantin et
al. 2025).
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig
from megatron_rlhf.convert.llama import torch_dtype, transformer_config_from_hf
from megatron_rlhf.convert.sharding import padded_vocab_size
from megatron_rlhf.learner import parallel
from megatron_rlhf.learner.batching import padding_fraction, plan_microbatches, row_lengths
from megatron_rlhf.learner.checkpoint import load_learner_checkpoint, save_learner_checkpoint
from megatron_rlhf.learner.logprobs import masked_sum as _masked_sum
from megatron_rlhf.learner.model import build_gpt_model, load_hf_config
from megatron_rlhf.learner.schedule import make_microbatch, run_microbatches
from megatron_rlhf.learner.weights import (buckets, finalize_hf_folder, iter_stage_hf_tensors,
                                           load_hf_weights, mark_tensor_parallel, prepare_hf_dir,
                                           write_hf_shards)
from megatron_rlhf.losses.dpo import dpo_loss
from megatron_rlhf.platform import get_platform
from megatron_rlhf.runtime import pin_to_core
from megatron_rlhf.types import LearnerBatch

__all__ = ["MegatronLearner"]

log = logging.getLogger(__name__)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` token logprobs and 0/1 mask -> ``[B]`` float32 row sums, accumulated in float64
    so that the same token values give the same sum whatever the row's padded length (the
    association of a float32 reduction depends on it: 1 ulp is ~8e-6 at |sum| ~ 100)."""
    return _masked_sum(values.double(), mask.to(values.device).double()).float()


class MegatronLearner:
    """Policy and reference megatron GPTModels plus optimizer state, trained with Online DPO.

    Args:
        model_dir: HF model folder (config, safetensors, tokenizer) the policy and the reference
            start from (each rank reads only its own shards).
        learner_cfg: ``LearnerConfig`` (parallel sizes, ``micro_batch_size``, ``optimizer``,
            ``ref_sync_interval``, ``distributed_optimizer``, ``sequence_parallel``, ``recompute``).
        algorithm_cfg: ``AlgorithmConfig`` (``beta``).
        dtype: parameter dtype (``float32`` on CPU; ``bfloat16`` on GPU trains with fp32 master
            weights).
        seed: seeds torch and megatron's RNG tracker.
        total_steps: optimizer steps of the run (LR decay length).
        cpu_core: pin this process to that core (-1: no pinning).
        rank, world_size: this process in the learner group; ``world_size`` defaults to
            ``tensor_parallel * pipeline_parallel * data_parallel``.
        init_method: torch.distributed rendezvous (``tcp://HOST:PORT``); required when
            ``world_size > 1`` (None: a free loopback port, world size 1 only).
    Raises:
        ValueError: ``world_size`` differs from the configured layout, the model cannot be
            split (heads / query groups / FFN not divisible by TP, layers not by PP), or
            ``learner.recompute=full`` on CPU.
    Attributes:
        weight_version: number of batches trained (restored by ``load_checkpoint``).
    """

    def __init__(self, *, model_dir: str, learner_cfg: LearnerConfig, algorithm_cfg: AlgorithmConfig,
                 dtype: str = "float32", seed: int = 0, total_steps: int = 1, cpu_core: int = -1,
                 rank: int = 0, world_size: int | None = None, init_method: str | None = None):
        t0 = time.perf_counter()
        tp, pp, dp = learner_cfg.tensor_parallel, learner_cfg.pipeline_parallel, learner_cfg.data_parallel
        world_size = tp * pp * dp if world_size is None else int(world_size)
        if world_size != tp * pp * dp:
            raise ValueError(f"MegatronLearner: world_size={world_size} but learner.tensor_parallel*"
                             f"pipeline_parallel*data_parallel = {tp}*{pp}*{dp} = {tp * pp * dp}")
        pin_to_core(cpu_core)
        self.model_dir = str(model_dir)
        self.cfg, self.algo = learner_cfg, algorithm_cfg
        self.dtype = torch_dtype(dtype)
        self.total_steps = int(total_steps)
        self.platform = get_platform()
        # the global CUDA->CPU function mode is only needed by pipeline schedules (PP > 1)
        self.platform.install(function_mode=pp > 1)
        if not self.platform.is_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        self.groups = parallel.acquire(backend=self.platform.dist_backend, tp=tp, pp=pp, rank=rank,
                                       world_size=world_size, init_method=init_method)
        self._closed = False
        pg = self.groups.pg_collection
        self.tp_rank, self.pp_rank, self.dp_rank = pg.tp.rank(), pg.pp.rank(), pg.dp.rank()
        self.platform.seed(seed)
        self.hf_config = load_hf_config(model_dir)
        self._check_divisible()
        self.vocab_size = int(self.hf_config.vocab_size)
        self.padded_vocab = padded_vocab_size(self.vocab_size, tp)
        self.sequence_parallel = bool(learner_cfg.sequence_parallel and tp > 1)
        self.tconfig = transformer_config_from_hf(
            self.hf_config, dtype=self.dtype, tp=tp, pp=pp, perform_initialization=False,
            sequence_parallel=self.sequence_parallel, **self._pipeline_overrides(),
            **self._feature_overrides())
        self.policy = self._build()
        self.reference = self._build()
        self.reference.requires_grad_(False).eval()
        self.ddp, self.optimizer, self.scheduler = self._build_optimizer()
        self.weight_version = 0
        log.info("MegatronLearner rank %d/%d (tp %d, pp %d, dp %d) ready in %.1f s (%s, %d local params)",
                 self.groups.rank, world_size, self.tp_rank, self.pp_rank, self.dp_rank,
                 time.perf_counter() - t0, self.hf_config.model_type,
                 sum(p.numel() for p in self.policy.parameters()))

    # ----------------------------------------------------------------------------- building
    def _check_divisible(self) -> None:
        h, tp, pp = self.hf_config, self.cfg.tensor_parallel, self.cfg.pipeline_parallel
        kv = getattr(h, "num_key_value_heads", None) or h.num_attention_heads
        for what, n, k, key in (("num_attention_heads", h.num_attention_heads, tp, "tensor_parallel"),
                                ("num_key_value_heads", kv, tp, "tensor_parallel"),
                                ("intermediate_size", h.intermediate_size, tp, "tensor_parallel"),
                                ("num_hidden_layers", h.num_hidden_layers, pp, "pipeline_parallel")):
            if n % k:
                raise ValueError(f"model {what}={n} is not divisible by learner.{key}={k}; "
                                 f"choose a divisor of {n}")

    def _pipeline_overrides(self) -> dict:
        """PP > 1: ``variable_seq_lengths`` (p2p sends each micro-batch's shape first, so
        length-grouped micro-batches can differ); megatron's config check then also asks for the
        ``alltoall`` MoE dispatcher, which has no effect on a dense model."""
        if self.cfg.pipeline_parallel == 1:
            return {}
        return {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}

    def _feature_overrides(self) -> dict:
        """TransformerConfig fields for GPU-only kernels: fused SwiGLU (megatron's jit
        ``bias_swiglu_impl``), TE's fused RoPE when TE imports, activation recomputation.
        Empty on CPU except recomputation. TE itself comes in through ``platform.layer_spec``."""
        out = {}
        if self.cfg.recompute == "full":
            if self.platform.is_cpu:  # tensor_parallel.checkpoint saves/restores CUDA RNG states
                raise ValueError("learner.recompute=full needs a GPU (megatron's activation "
                                 "checkpointing saves CUDA RNG states); use recompute=none on CPU")
            out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if self.platform.is_cpu:
            return out
        from megatron_rlhf.platform.gpu import have_transformer_engine

        out.update(bias_activation_fusion=True, apply_rope_fusion=have_transformer_engine())
        return out

    def _build(self):
        model = build_gpt_model(self.hf_config, self.tconfig, platform=self.platform,
                                pg_collection=self.groups.pg_collection,
                                pre_process=self.groups.is_first_stage,
                                post_process=self.groups.is_last_stage,
                                vocab_size=self.padded_vocab)
        mark_tensor_parallel(model, self.hf_config)  # before DDP/optimizer read the attributes
        load_hf_weights(model, self.model_dir, self.hf_config, tp_rank=self.tp_rank,
                        tp=self.groups.tp, padded_vocab=self.padded_vocab)
        return model

    def _build_optimizer(self):
        """Megatron DDP (fp32 grad buffer; grad-reduce overlap on GPU with DP > 1),
        ``get_megatron_optimizer`` (Adam, decoupled weight decay, global-norm clip; distributed
        optimizer per ``learner.distributed_optimizer``) and ``OptimizerParamScheduler``
        (see :meth:`_lr_schedule_args`)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.cfg.optimizer
        self.overlap_grad_reduce = not self.platform.is_cpu and self.groups.dp > 1
        self.use_distributed_optimizer = bool(self.cfg.distributed_optimizer)
        ddp = DistributedDataParallel(
            config=self.tconfig, module=self.policy, pg_collection=self.groups.pg_collection,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=self.overlap_grad_reduce,
                use_distributed_optimizer=self.use_distributed_optimizer,
                average_in_collective=True))
        if self.overlap_grad_reduce:
            self.tconfig.no_sync_func = ddp.no_sync  # pipeline schedules defer the reduction
        ocfg = McoreOptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, bf16=self.dtype == torch.bfloat16, fp16=False,
            params_dtype=self.dtype, use_distributed_optimizer=self.use_distributed_optimizer)
        with self.platform.optimizer_context():  # FP32Optimizer allocates on device='cuda'
            optimizer = get_megatron_optimizer(ocfg, [ddp])
        scheduler = OptimizerParamScheduler(optimizer, **self._lr_schedule_args())
        return ddp, optimizer, scheduler

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

    def _plans(self, lengths: list[int], pairs: bool):
        pad = self.groups.tp if self.sequence_parallel else 1
        return [plan_microbatches(lengths, rows_per_microbatch=self.cfg.micro_batch_size,
                                  dp_rank=d, dp_size=self.groups.dp, pairs=pairs, pad_multiple=pad)
                for d in range(self.groups.dp)]

    def _gather_dp(self, obj) -> list:
        """``obj`` of every DP rank of this (TP rank, PP stage), in DP rank order."""
        if self.groups.dp == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.groups.dp
        dist.all_gather_object(out, obj, group=self.groups.pg_collection.dp)
        return out

    def _run(self, model, mbs, on_logprobs, *, forward_only: bool) -> None:
        run_microbatches(model, mbs, on_logprobs, forward_only=forward_only, pp=self.groups.pp,
                         pg_collection=self.groups.pg_collection, vocab_size=self.vocab_size,
                         padded_vocab=self.padded_vocab, tp_rank=self.tp_rank, tp=self.groups.tp,
                         no_sync=self.ddp.no_sync if self.overlap_grad_reduce and not forward_only else None)

    def _forward_token_logprobs(self, model, mbs) -> list:
        """Forward-only pass over ``mbs``; on the last stage ``[b_k, s_k]`` CPU token logprobs per
        micro-batch, elsewhere ``[]``."""
        out = [None] * len(mbs)

        def keep(k, mb, tok):
            out[k] = tok.detach().float().cpu()

        if mbs:
            was_training = model.training
            model.eval()
            try:
                self._run(model, mbs, keep, forward_only=True)
            finally:
                model.train(was_training)
        return out if self.groups.is_last_stage else []

    # ----------------------------------------------------------------------------- logprobs
    def token_logprobs(self, input_ids, which: str = "policy") -> torch.Tensor | None:
        """Teacher-forced token logprobs (rows dealt over DP, micro-batches of ``micro_batch_size``).

        Args:
            input_ids: ``[B, S]`` int64 (right-padded) tensor or nested list.
            which: ``policy`` or ``reference``.
        Returns:
            on last-stage ranks ``[B, S]`` float32 CPU tensor: column t = log p(x_t | x_<t)
            (nats), column 0 = 0; None on other pipeline stages.
        """
        model = self._model(which)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        b, s = ids.shape
        plan = self._plans(row_lengths(None, s, b), pairs=False)[self.dp_rank]
        mbs = [make_microbatch(ids, mb.rows, mb.seq_len, self.platform.device) for mb in plan]
        toks = self._forward_token_logprobs(model, mbs)
        if not self.groups.is_last_stage:
            return None
        out = torch.zeros(b, s)
        for part in self._gather_dp([(mb.rows, t[:, :s]) for mb, t in zip(mbs, toks)]):
            for rows, t in part:
                out[list(rows)] = t
        return out

    def sequence_logprobs(self, input_ids, loss_mask, which: str = "policy") -> torch.Tensor | None:
        """Sum of token logprobs over positions with ``loss_mask`` = 1, each row cut to its real
        length (:mod:`~megatron_rlhf.learner.batching`).

        Args:
            input_ids, loss_mask: ``[B, S]`` (mask as in ``LearnerBatch``: 1 on completion tokens).
            which: ``policy`` or ``reference``.
        Returns:
            ``[B]`` float32 (nats) on last-stage ranks; None on other pipeline stages.
        """
        model = self._model(which)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        mask = torch.as_tensor(loss_mask, dtype=torch.float32)
        b, s = ids.shape
        plan = self._plans(row_lengths(mask, s, b), pairs=False)[self.dp_rank]
        mbs = [make_microbatch(ids, mb.rows, mb.seq_len, self.platform.device, loss_mask=mask)
               for mb in plan]
        toks = self._forward_token_logprobs(model, mbs)
        if not self.groups.is_last_stage:
            return None
        out = torch.zeros(b)
        for part in self._gather_dp([(mb.rows, masked_sum(t, mb.loss_mask)) for mb, t in zip(mbs, toks)]):
            for rows, v in part:
                out[list(rows)] = v
        return out

    # ----------------------------------------------------------------------------- training
    def train_step(self, batch: LearnerBatch) -> dict[str, float]:
        """One Online DPO optimizer step on ``batch.num_pairs`` pairs (see module doc).

        Args:
            batch: ``input_ids``/``loss_mask``/``sampling_logprobs`` ``[2P, S]``; rows 2i / 2i+1 are
                pair i's chosen / rejected sequences.
        Returns:
            float metrics. Every rank: ``grad/norm`` (global, before clipping), ``lr``,
            ``train/update_ok``, ``train/num_pairs``, ``train/tokens``, ``train/microbatches``,
            ``batch/padding_fraction`` (padded slots / all slots the micro-batches ran),
            ``batch/padding_fraction_unsorted`` (the same for the ``[2P, S]`` batch as given),
            ``ref/synced`` (1.0 when the reference was reset to the policy after this step),
            ``time/train_s``. Last-stage ranks add ``loss/total``, ``dpo/margin``,
            ``dpo/accuracy``, ``dpo/chosen_reward``, ``dpo/rejected_reward``,
            ``logprobs/policy_chosen_mean``, ``logprobs/vllm_gap_abs_mean`` and
            ``logprobs/vllm_gap_abs_max`` (|learner - generator| token logprob over completion
            tokens, before the update; NaN without ``sampling_logprobs``), all over all P pairs.
        Raises:
            ValueError: odd number of rows, mismatched shapes, or fewer pairs than DP ranks.
        """
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        t0 = time.perf_counter()
        ids = torch.as_tensor(batch.input_ids, dtype=torch.long)
        mask = torch.as_tensor(batch.loss_mask, dtype=torch.float32)
        if ids.dim() != 2 or ids.shape[0] % 2 or ids.shape[0] == 0 or mask.shape != ids.shape:
            raise ValueError(f"train_step: input_ids {tuple(ids.shape)} must be [2P, S] with P >= 1 "
                             f"and loss_mask the same shape (got {tuple(mask.shape)})")
        num_pairs, (b, s) = ids.shape[0] // 2, ids.shape
        if num_pairs < self.groups.dp:
            raise ValueError(f"train_step: {num_pairs} pairs cannot be split over learner.data_parallel="
                             f"{self.groups.dp} ranks; set algorithm.pairs_per_step >= {self.groups.dp}")
        slp = None if batch.sampling_logprobs is None else torch.as_tensor(batch.sampling_logprobs,
                                                                            dtype=torch.float32)
        lengths = row_lengths(mask, s, b)
        plans = self._plans(lengths, pairs=True)
        extra = {} if slp is None else {"slp": slp}
        mbs = [make_microbatch(ids, mb.rows, mb.seq_len, self.platform.device, loss_mask=mask, **extra)
               for mb in plans[self.dp_rank]]
        for mb, tok in zip(mbs, self._forward_token_logprobs(self.reference, mbs)):
            mb.extra["ref_seq"] = masked_sum(tok, mb.loss_mask)                    # [b_k]
        records: list[dict] = []
        scale = self.groups.dp / num_pairs * len(mbs)  # megatron divides each loss by len(mbs)

        def dpo_microbatch(k, mb, tok):
            seq = masked_sum(tok, mb.loss_mask.to(tok.device))                      # [b_k]
            ref = mb.extra["ref_seq"].to(seq.device)
            loss, _ = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], self.algo.beta)
            records.append({"rows": mb.rows, "pol": seq.detach().cpu(), "ref": ref.detach().cpu(),
                            **self._gap_stats(tok.detach().cpu(), mb)})
            return loss * (seq.shape[0] // 2) * scale

        self.policy.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self.ddp, mbs, dpo_microbatch, forward_only=False)
        finalize_model_grads([self.ddp], pg_collection=self.groups.pg_collection)
        self.scheduler.step(1)  # LR of this step (see _lr_schedule_args)
        with self.platform.optimizer_context():
            ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:
            grad_norm = self.optimizer.get_grad_norm()
        self.weight_version += 1
        r = self.cfg.ref_sync_interval
        synced = bool(r) and self.weight_version % r == 0
        if synced:
            self.sync_reference()
        metrics = {"grad/norm": float(grad_norm), "lr": self._lr(), "train/update_ok": float(bool(ok)),
                   "train/num_pairs": float(num_pairs), "train/tokens": float(mask.sum()),
                   "train/microbatches": float(sum(len(p) for p in plans)),
                   "batch/padding_fraction": padding_fraction(lengths, plans),
                   "batch/padding_fraction_unsorted": 1.0 - sum(lengths) / float(b * s),
                   "ref/synced": float(synced)}
        if self.groups.is_last_stage:
            metrics.update(self._dpo_metrics(self._gather_dp(records), b))
        metrics["time/train_s"] = time.perf_counter() - t0
        return metrics

    @staticmethod
    def _gap_stats(tok: torch.Tensor, mb) -> dict:
        """Sum / max / count of |learner - generator| token logprob over this micro-batch's
        completion tokens (empty when the batch has no ``sampling_logprobs``)."""
        slp = mb.extra.get("slp")
        sel = mb.loss_mask > 0
        if slp is None or not bool(sel.any()):
            return {}
        gap = (tok - slp).abs()[sel]
        return {"gap_sum": float(gap.sum()), "gap_max": float(gap.max()), "gap_n": int(sel.sum())}

    def _dpo_metrics(self, parts: list[list[dict]], num_rows: int) -> dict[str, float]:
        """DPO metrics over all pairs from every DP rank's per-micro-batch records."""
        pol, ref = torch.zeros(num_rows), torch.zeros(num_rows)
        gap_sum, gap_max, gap_n = 0.0, float("nan"), 0
        for part in parts:
            for rec in part:
                idx = list(rec["rows"])
                pol[idx], ref[idx] = rec["pol"], rec["ref"]
                if "gap_n" in rec:
                    gap_sum += rec["gap_sum"]
                    gap_n += rec["gap_n"]
                    gap_max = rec["gap_max"] if gap_max != gap_max else max(gap_max, rec["gap_max"])
        loss, m = dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], self.algo.beta)
        return {"loss/total": float(loss), **{k: float(v) for k, v in m.items()},
                "logprobs/policy_chosen_mean": float(pol[0::2].mean()),
                "logprobs/vllm_gap_abs_mean": gap_sum / gap_n if gap_n else float("nan"),
                "logprobs/vllm_gap_abs_max": gap_max}

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ----------------------------------------------------------------------------- weights
    def _stage_hf_tensors(self, which: str = "policy", what: str = "param"):
        """This stage's full HF-named tensors (TP-gathered; yielded on TP rank 0 only)."""
        tp_group = self.groups.pg_collection.tp if self.groups.tp > 1 else None
        return iter_stage_hf_tensors(self._model(which), self.hf_config, tp_group=tp_group, what=what)

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
            shards = write_hf_shards(self._stage_hf_tensors(), tmp, f"stage{self.pp_rank:03d}",
                                     max_shard_bytes)
        parts = [(self.pp_rank, shards)]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, (self.pp_rank, shards))
        if self.groups.rank == 0:
            ordered = [sh for _, stage in sorted(parts, key=lambda x: x[0]) for sh in stage]
            finalize_hf_folder(tmp, out, base_model_dir, ordered)
        if world > 1:
            dist.barrier()

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Save policy and reference (megatron ``dist_checkpointing``, torch_dist format, under
        ``path/policy`` and ``path/reference``: every rank writes its own shards) and the
        optimizer, LR scheduler, RNG states and ``weight_version`` (``torch.save``: rank 0 to
        ``path/learner_state.pt``, rank r > 0 to ``path/learner_state.rank<r>.pt``). ``path`` is
        created. Collective over all ranks.

        Raises:
            NotImplementedError: with ``learner.distributed_optimizer=true`` (not supported yet).
        """
        save_learner_checkpoint(self, Path(path))

    def load_checkpoint(self, path: str) -> int:
        """Restore everything :meth:`save_checkpoint` wrote; returns the restored weight_version.

        Raises:
            FileNotFoundError: ``path`` is not a complete learner checkpoint.
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
        self.policy = self.reference = self.ddp = self.optimizer = self.scheduler = None
        parallel.release()

    def __del__(self):  # best effort; explicit close() is the contract
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    # RNG helpers used by checkpoint.py
    @staticmethod
    def _rng_state() -> dict:
        import numpy as np

        return {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    @staticmethod
    def _set_rng_state(state: dict) -> None:
        import numpy as np

        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

