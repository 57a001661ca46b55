"""Run micro-batches through a (possibly pipelined) critic GPTModel whose output layer is a scalar
value head, and hand each micro-batch's token-aligned values to a loss callback.

    run_value_microbatches(model, mbs, on_values, forward_only=False, pp=2, pg_collection=pg)

The critic (:mod:`megatron_rlhf.learner.critic`) returns ``[b, s, 1]`` from ``GPTModel.forward``
without labels (megatron-core 0.16.1 ``GPTModel._postprocess``: ``labels is None`` returns the
output layer's result transposed to batch-first). The value of position t is the head applied to
the hidden state at t-1, the state x_<t that token x_t is sampled from, so values line up with
token logprobs (:mod:`megatron_rlhf.learner.logprobs`: column t = log p(x_t | x_<t)); column 0 = 0.

Same schedule as :func:`megatron_rlhf.learner.schedule.run_microbatches` (which is specific to
logprobs): PP > 1 goes through megatron-core's ``get_forward_backward_func`` with
``variable_seq_lengths``; PP = 1 is the equivalent plain loop. Like megatron's schedules, the loss
returned by ``on_values`` is divided by the number of micro-batches before backward.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rlhf.learner.logprobs import _shift, position_ids_for
from megatron_rlhf.learner.schedule import MicroBatchData, run_schedule

__all__ = ["run_value_microbatches", "token_values"]


def token_values(head_out: torch.Tensor) -> torch.Tensor:
    """Last-stage critic output ``[b, s, 1]`` (value of the prefix ending at column t) ->
    ``[b, s]`` float32 values aligned with token logprobs: column t = V(x_<t) = output at t-1,
    column 0 = 0. Differentiable."""
    if head_out.dim() != 3 or head_out.shape[-1] != 1:
        raise ValueError(f"token_values: expected the value head's [b, s, 1] output, got "
                         f"{tuple(head_out.shape)} (is the output layer a ValueHead?)")
    return _shift(head_out[..., 0].float())


def run_value_microbatches(model, mbs: list[MicroBatchData],
                           on_values: Callable[[int, MicroBatchData, torch.Tensor], torch.Tensor | None],
                           *, forward_only: bool, pp: int, pg_collection, no_sync=None) -> None:
    """Forward (and backward unless ``forward_only``) every micro-batch of ``mbs`` in order.

    Args:
        model: critic GPTModel or megatron DDP of one (this rank's pipeline stage).
        mbs: this rank's micro-batches (every stage of a pipeline gets the same list); empty: no-op.
        on_values: ``(k, mb, values [b, s] float32) -> scalar loss`` called on the last stage for
            micro-batch k (values from :func:`token_values`, not masked); with ``forward_only``
            its return value is ignored (may be None).
        forward_only: no backward (and ``torch.no_grad``).
        pp: pipeline size; pg_collection: megatron ``ProcessGroupCollection`` of this rank.
        no_sync: context-manager factory deferring DP grad reduction for all but the last
            micro-batch (megatron DDP's ``no_sync``, PP = 1 only; PP > 1 reads
            ``config.no_sync_func``), or None.
    Raises:
        ValueError: PP > 1 without ``TransformerConfig.variable_seq_lengths``.
    """
    if not mbs:
        return

    def forward_step(data_iterator, m):
        k, mb = next(data_iterator)
        ids = mb.input_ids
        output = m(input_ids=ids, position_ids=position_ids_for(ids), attention_mask=None)

        def loss_func(out):
            vals = token_values(out)
            loss = on_values(k, mb, vals)
            if loss is None or forward_only:
                loss = vals.sum() * 0.0
            return loss, {}

        return output, loss_func

    run_schedule(model, mbs, forward_step, forward_only=forward_only, pp=pp, pg_collection=pg_collection,
                 no_sync=no_sync, caller="run_value_microbatches")
