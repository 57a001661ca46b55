"""Megatron DDP + optimizer + LR scheduler for one trainable model (the policy, or PPO's critic).

One recipe for both so their optimizers cannot drift apart: megatron-core
``DistributedDataParallel`` (fp32 grad buffer, averaged in the collective; grad-reduce overlap on
GPU with DP > 1), ``get_megatron_optimizer`` (Adam, decoupled weight decay, global-norm clip,
optionally the distributed optimizer) and ``OptimizerParamScheduler``. Source: megatron-core
0.16 ``megatron/core/distributed`` and ``megatron/core/optimizer`` (``OptimizerConfig`` fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TrainState", "all_finite", "build_train_state"]


@dataclass
class TrainState:
    """What :func:`build_train_state` returns.

    Attributes:
        ddp: the megatron DDP wrapper of the model.
        optimizer: megatron optimizer over the DDP buffers.
        scheduler: ``OptimizerParamScheduler`` (advance it before each optimizer step).
        overlap_grad_reduce: DP grad reduction overlapped with backward (GPU, DP > 1).
        use_distributed_optimizer: Adam state and fp32 master weights sharded over DP.
    """

    ddp: Any
    optimizer: Any
    scheduler: Any
    overlap_grad_reduce: bool
    use_distributed_optimizer: bool


def build_train_state(*, module, tconfig, groups, platform, optimizer_cfg, dtype: torch.dtype,
                      distributed_optimizer: bool, schedule_args: dict, lr: float | None = None
                      ) -> TrainState:
    """DDP, optimizer and scheduler for ``module``.

    Args:
        module: this rank's megatron model (stage).
        tconfig: its ``TransformerConfig``; its ``no_sync_func`` is set to DDP's ``no_sync`` when
            grad reduction overlaps (pipeline schedules defer the reduction with it), else None.
        groups: ``learner.parallel`` groups (``pg_collection``, ``dp``).
        platform: the CPU/GPU platform (``is_cpu``, ``optimizer_context``).
        optimizer_cfg: ``learner.optimizer`` (lr, min_lr, weight_decay, adam_beta1/2, adam_eps,
            clip_grad).
        dtype: parameter dtype (bf16 params train with fp32 master weights).
        distributed_optimizer: ``learner.distributed_optimizer``.
        schedule_args: ``OptimizerParamScheduler`` keyword arguments (``max_lr``/``min_lr``
            included).
        lr: peak learning rate (None: ``optimizer_cfg.lr``); ``min_lr`` is scaled by
            ``lr / optimizer_cfg.lr`` so the schedule keeps its shape.
    Returns:
        :class:`TrainState`.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = optimizer_cfg
    lr = o.lr if lr is None else float(lr)
    ratio = lr / o.lr if o.lr > 0 else 1.0
    overlap = not platform.is_cpu and groups.dp > 1
    dist_opt = bool(distributed_optimizer)
    ddp = DistributedDataParallel(
        config=tconfig, module=module, pg_collection=groups.pg_collection,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, use_distributed_optimizer=dist_opt,
            average_in_collective=True))
    tconfig.no_sync_func = ddp.no_sync if overlap else None
    ocfg = McoreOptimizerConfig(
        optimizer="adam", lr=lr, min_lr=o.min_lr * ratio, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16, fp16=False,
        params_dtype=dtype, use_distributed_optimizer=dist_opt)
    with platform.optimizer_context():  # FP32Optimizer allocates on device='cuda'
        optimizer = get_megatron_optimizer(ocfg, [ddp])
    args = dict(schedule_args)
    if ratio != 1.0:
        args.update(max_lr=lr, min_lr=args["min_lr"] * ratio)
    scheduler = OptimizerParamScheduler(optimizer, **args)
    return TrainState(ddp=ddp, optimizer=optimizer, scheduler=scheduler, overlap_grad_reduce=overlap,
                      use_distributed_optimizer=dist_opt)


def all_finite(losses: list[torch.Tensor], ddp, device) -> bool:
    """Whether every rank's micro-batch losses and (finalised) gradient buffers of ``ddp`` are
    finite: a flag all-reduced (MAX of "bad") over every rank of the default process group (all
    learner ranks: TP, PP and DP), so every rank takes the same skip decision (collective).

    Args:
        losses: this rank's micro-batch losses (any shapes; empty on stages that compute none).
        ddp: the megatron DDP wrapper whose ``buffers`` / ``expert_parallel_buffers`` hold the grads.
        device: where the flag lives for the all-reduce (the platform's device: gloo CPU, NCCL CUDA).
    """
    import torch.distributed as dist

    bad = any(not bool(torch.isfinite(loss).all()) for loss in losses)
    for buf in ddp.buffers + ddp.expert_parallel_buffers:
        bad = bad or not bool(torch.isfinite(buf.grad_data).all())
    flag = torch.tensor([float(bad)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())
