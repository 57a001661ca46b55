"""The Megatron learner: policy + frozen reference GPTModel, megatron DDP and optimizer, Online DPO.

A plain Python class; the trainer runs it as a Ray actor (``ray.remote(num_cpus=1)(MegatronLearner)``).
One process today (TP = PP = DP = 1, gloo on CPU); the process groups come from
:mod:`megatron_rlhf.learner.parallel` and are passed to megatron explicitly, so growing the
learner into a TP x PP x DP group changes the group setup and the full-tensor gather/scatter in
:mod:`megatron_rlhf.learner.model`, not this loop.

Per batch (``train_step``), Online DPO (Guo et al. 2024; Noukhovitch et al. 2024, sec. 2):
reference sequence logprobs once (no grad); policy forward/backward in micro-batches of
``learner.micro_batch_size`` sequences (a pair's chosen and rejected rows stay together); the loss
of micro-batch m is ``dpo_loss(pairs of m) * P_m / P`` so the accumulated gradient equals the
gradient of the mean DPO loss over all P pairs; one optimizer step; ``weight_version += 1``.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig
from megatron_rlhf.convert.llama import (hf_to_mcore, iter_mcore_to_hf, torch_dtype,
                                         transformer_config_from_hf)
from megatron_rlhf.learner import parallel
from megatron_rlhf.learner.checkpoint import load_learner_checkpoint, save_learner_checkpoint
from megatron_rlhf.learner.logprobs import masked_sum, token_logprobs
from megatron_rlhf.learner.model import (build_gpt_model, full_mcore_state, load_hf_config,
                                         load_hf_state_dict, load_mcore_state)
from megatron_rlhf.losses.dpo import dpo_loss
from megatron_rlhf.platform import get_platform
from megatron_rlhf.runtime import pin_to_core
from megatron_rlhf.types import LearnerBatch

__all__ = ["MegatronLearner"]

log = logging.getLogger(__name__)


class MegatronLearner:
    """Policy and reference megatron GPTModels plus optimizer state, trained with Online DPO.

    Args:
        model_dir: HF model folder (config, safetensors, tokenizer) the policy and the reference
            start from.
        learner_cfg: ``LearnerConfig`` (parallel sizes, ``micro_batch_size``, ``optimizer``).
        algorithm_cfg: ``AlgorithmConfig`` (``beta``).
        dtype: parameter dtype (``float32`` on CPU).
        seed: seeds torch and megatron's RNG tracker.
        total_steps: optimizer steps of the run (LR decay length).
        cpu_core: pin this process to that core (-1: no pinning).
    Raises:
        NotImplementedError: TP/PP/DP > 1 (multi-process learner groups come later).
    Attributes:
        weight_version: number of batches trained (restored by ``load_checkpoint``).
    """

    def __init__(self, *, model_dir: str, learner_cfg: LearnerConfig, algorithm_cfg: AlgorithmConfig,
                 dtype: str = "float32", seed: int = 0, total_steps: int = 1, cpu_core: int = -1):
        t0 = time.perf_counter()
        if learner_cfg.tensor_parallel * learner_cfg.pipeline_parallel * learner_cfg.data_parallel != 1:
            raise NotImplementedError("MegatronLearner: learner.tensor_parallel/pipeline_parallel/"
                                      "data_parallel must be 1 for now")
        pin_to_core(cpu_core)
        self.model_dir = str(model_dir)
        self.cfg, self.algo = learner_cfg, algorithm_cfg
        self.dtype = torch_dtype(dtype)
        self.total_steps = int(total_steps)
        self.platform = get_platform()
        # the global CUDA->CPU function mode is only needed by pipeline schedules (PP > 1)
        self.platform.install(function_mode=learner_cfg.pipeline_parallel > 1)
        self.groups = parallel.acquire(backend=self.platform.dist_backend,
                                       tp=learner_cfg.tensor_parallel, pp=learner_cfg.pipeline_parallel)
        self._closed = False
        self.platform.seed(seed)
        self.hf_config = load_hf_config(model_dir)
        self.tconfig = transformer_config_from_hf(
            self.hf_config, dtype=self.dtype, tp=learner_cfg.tensor_parallel,
            pp=learner_cfg.pipeline_parallel, perform_initialization=False)
        mcore_state = hf_to_mcore(load_hf_state_dict(model_dir), self.hf_config)
        self.policy = self._build(mcore_state)
        self.reference = self._build(mcore_state)
        self.reference.requires_grad_(False).eval()
        del mcore_state
        self.ddp, self.optimizer, self.scheduler = self._build_optimizer()
        self.weight_version = 0
        log.info("MegatronLearner ready in %.1f s (%s, %d params)", time.perf_counter() - t0,
                 self.hf_config.model_type, sum(p.numel() for p in self.policy.parameters()))

    # ----------------------------------------------------------------------------- building
    def _build(self, mcore_state):
        model = build_gpt_model(self.hf_config, self.tconfig, platform=self.platform,
                                pg_collection=self.groups.pg_collection,
                                pre_process=self.groups.is_first_stage,
                                post_process=self.groups.is_last_stage)
        load_mcore_state(model, mcore_state)
        return model

    def _build_optimizer(self):
        """Megatron DDP (fp32 grad buffer), ``get_megatron_optimizer`` (Adam, decoupled weight
        decay, global-norm clip) and ``OptimizerParamScheduler`` (see :meth:`_lr_schedule_args`)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.cfg.optimizer
        ddp = DistributedDataParallel(
            config=self.tconfig, module=self.policy, pg_collection=self.groups.pg_collection,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                     overlap_grad_reduce=False,
                                                     use_distributed_optimizer=False,
                                                     average_in_collective=True))
        ocfg = McoreOptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, bf16=self.dtype == torch.bfloat16, fp16=False,
            params_dtype=self.dtype, use_distributed_optimizer=False)
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

    # ----------------------------------------------------------------------------- logprobs
    @torch.no_grad()
    def token_logprobs(self, input_ids, which: str = "policy") -> torch.Tensor:
        """Teacher-forced token logprobs, in micro-batches of ``micro_batch_size`` rows.

        Args:
            input_ids: ``[B, S]`` int64 (right-padded) tensor or nested list.
            which: ``policy`` or ``reference``.
        Returns:
            ``[B, S]`` float32 CPU tensor: column t = log p(x_t | x_<t) (nats), column 0 = 0.
        """
        model = self._model(which)
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        was_training = model.training
        model.eval()
        try:
            mbs = self.cfg.micro_batch_size
            out = [token_logprobs(model, ids[i:i + mbs].to(self.platform.device)).cpu()
                   for i in range(0, ids.shape[0], mbs)]
        finally:
            model.train(was_training)
        return torch.cat(out)

    def sequence_logprobs(self, input_ids, loss_mask, which: str = "policy") -> torch.Tensor:
        """``[B]`` float32: sum over positions with ``loss_mask`` = 1 of the token logprobs
        (``input_ids``/``loss_mask`` ``[B, S]``, mask as in ``LearnerBatch``)."""
        lp = self.token_logprobs(input_ids, which)
        return masked_sum(lp, torch.as_tensor(loss_mask, dtype=torch.float32))

    # ----------------------------------------------------------------------------- training
    def train_step(self, batch: LearnerBatch) -> dict[str, float]:
        """One Online DPO optimizer step on ``batch.num_pairs`` pairs (see module doc).

        Args:
            batch: ``input_ids``/``loss_mask``/``sampling_logprobs`` ``[2P, S]``; rows 2i / 2i+1 are
                pair i's chosen / rejected sequences.
        Returns:
            float metrics: ``loss/total``, ``dpo/margin``, ``dpo/accuracy``, ``dpo/chosen_reward``,
            ``dpo/rejected_reward``, ``grad/norm`` (before clipping), ``lr``,
            ``logprobs/vllm_gap_abs_mean`` and ``logprobs/vllm_gap_abs_max`` (|learner - generator|
            token logprob over completion tokens, before the update; NaN without
            ``sampling_logprobs``), ``logprobs/policy_chosen_mean``, ``train/tokens``,
            ``train/num_pairs``, ``time/train_s``.
        Raises:
            ValueError: odd number of rows or mismatched shapes.
        """
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        t0 = time.perf_counter()
        ids = torch.as_tensor(batch.input_ids, dtype=torch.long)
        mask = torch.as_tensor(batch.loss_mask, dtype=torch.float32)
        if ids.dim() != 2 or ids.shape[0] % 2 or mask.shape != ids.shape:
            raise ValueError(f"train_step: input_ids {tuple(ids.shape)} must be [2P, S] with P >= 1 "
                             f"and loss_mask the same shape (got {tuple(mask.shape)})")
        num_pairs, beta = ids.shape[0] // 2, self.algo.beta
        ref_lp = self.sequence_logprobs(ids, mask, "reference")           # [2P]
        pairs_per_mb = max(1, self.cfg.micro_batch_size // 2)
        self.policy.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        pol_lp, pol_tok = torch.zeros(2 * num_pairs), torch.zeros_like(mask)
        for p0 in range(0, num_pairs, pairs_per_mb):
            rows = slice(2 * p0, 2 * min(num_pairs, p0 + pairs_per_mb))
            tok = token_logprobs(self.ddp, ids[rows].to(self.platform.device)).cpu()  # [2m, S]
            seq = masked_sum(tok, mask[rows])                                        # [2m]
            r = ref_lp[rows]
            loss, _ = dpo_loss(seq[0::2], seq[1::2], r[0::2], r[1::2], beta)
            (loss * (seq.shape[0] // 2) / num_pairs).backward()
            pol_lp[rows], pol_tok[rows] = seq.detach(), tok.detach()
        finalize_model_grads([self.ddp], pg_collection=self.groups.pg_collection)
        self.scheduler.step(1)  # LR of this step (see _lr_schedule_args)
        with self.platform.optimizer_context():
            ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:
            grad_norm = self.optimizer.get_grad_norm()
        self.weight_version += 1
        loss, m = dpo_loss(pol_lp[0::2], pol_lp[1::2], ref_lp[0::2], ref_lp[1::2], beta)
        metrics = {"loss/total": float(loss), **{k: float(v) for k, v in m.items()},
                   "grad/norm": float(grad_norm), "lr": self._lr(),
                   "train/update_ok": float(bool(ok)), "train/num_pairs": float(num_pairs),
                   "train/tokens": float(mask.sum()),
                   "logprobs/policy_chosen_mean": float(pol_lp[0::2].mean())}
        metrics.update(self._vllm_gap(pol_tok, mask, batch.sampling_logprobs))
        metrics["time/train_s"] = time.perf_counter() - t0
        return metrics

    @staticmethod
    def _vllm_gap(learner_tok, mask, sampling_logprobs) -> dict[str, float]:
        """|learner - generator| token logprob over completion tokens (mean, max); NaN if absent."""
        if sampling_logprobs is None or mask.sum() == 0:
            return {"logprobs/vllm_gap_abs_mean": float("nan"), "logprobs/vllm_gap_abs_max": float("nan")}
        gap = (learner_tok - torch.as_tensor(sampling_logprobs, dtype=torch.float32)).abs()[mask > 0]
        return {"logprobs/vllm_gap_abs_mean": float(gap.mean()),
                "logprobs/vllm_gap_abs_max": float(gap.max())}

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ----------------------------------------------------------------------------- weights
    def _hf_tensors(self, which: str = "policy"):
        """Yield (HF name, contiguous CPU copy) of the full model, in HF checkpoint order."""
        state = full_mcore_state(self._model(which))
        for name, t in iter_mcore_to_hf(state, self.hf_config):
            t = t.detach().to("cpu")
            if any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                   for s in state.values()):
                t = t.clone()  # never hand out views of live parameters
            yield name, t.contiguous()

    def export_weights(self, bucket_bytes: int = 256 * 2**20) -> list[dict[str, torch.Tensor]]:
        """The policy as HF-named full tensors, grouped into buckets of at most ``bucket_bytes``
        (a tensor larger than that gets its own bucket).

        Returns:
            list of ``{hf_name: tensor}``: exactly the names/shapes of the HF checkpoint (tied
            ``lm_head.weight`` omitted), contiguous CPU copies in the policy dtype.
        """
        buckets: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in self._hf_tensors("policy"):
            nbytes = t.numel() * t.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append({})
                size = 0
            buckets[-1][name] = t
            size += nbytes
        return buckets

    @torch.no_grad()
    def sync_reference(self) -> None:
        """Copy the policy's weights into the reference model (Lanchantin et al. 2025 ref sync)."""
        ref = dict(self.reference.named_parameters())
        for name, p in self.policy.named_parameters():
            ref[name].copy_(p)

    def export_hf(self, out_dir: str, base_model_dir: str) -> None:
        """Write the policy as an HF folder: safetensors weights (sharded by huggingface_hub
        when large) plus every non-weight file of ``base_model_dir`` (config, tokenizer, chat
        template, generation config). Written to a temporary sibling folder, then renamed.

        Raises:
            FileExistsError: ``out_dir`` exists and is not empty.
        """
        from megatron_rlhf.learner.checkpoint import write_hf_folder

        write_hf_folder(dict(self._hf_tensors("policy")), out_dir, base_model_dir)

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Save policy and reference (megatron ``dist_checkpointing``, torch_dist format, under
        ``path/policy`` and ``path/reference``) and the optimizer, LR scheduler, RNG states and
        ``weight_version`` (``torch.save`` to ``path/learner_state.pt``). ``path`` is created."""
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

