"""Token and sequence log-probabilities from a megatron GPTModel, without gathering the vocab.

The model is called with ``labels``: megatron then computes the per-token cross entropy with
``tensor_parallel.vocab_parallel_cross_entropy`` on the vocab-parallel logits (each TP rank holds
``V / tp`` columns; only ``[s, b]`` max / sum-exp / target-logit values are all-reduced), so the
full-vocab logits are never gathered, and log p = -CE. Source: megatron-core 0.16.1
``LanguageModule.compute_language_model_loss`` and ``tensor_parallel/cross_entropy.py``.

Conventions (shared with ``LearnerBatch`` and the generator's ``prompt_logprobs``):
``token_logprobs[b, t] = log p(x_t | x_<t)`` for t >= 1 and 0 at t = 0; per-token entropies are
aligned the same way (column t = entropy of the distribution that sampled x_t, column 0 = 0).

:func:`vocab_parallel_entropy` is the entropy counterpart of vocab-parallel cross entropy: each TP
rank reduces its ``V/tp`` logit columns to ``[b, s]`` partial sums that are all-reduced.
"""

from __future__ import annotations

import torch

__all__ = ["next_token_labels", "token_logprobs", "token_logprobs_from_logits", "masked_sum",
           "position_ids_for", "vocab_parallel_entropy"]


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """``labels[b, t] = input_ids[b, t+1]``; the last column (no next token) repeats
    ``input_ids[b, -1]`` (a valid id whose value is discarded). ``[B, S]`` -> ``[B, S]``."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)


def position_ids_for(input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions 0..S-1 (sequences are right-padded, so every row starts at 0)."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def _shift(next_lp: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` logprob of token t+1 at column t -> logprob of token t at column t (col 0 = 0)."""
    return torch.cat([next_lp.new_zeros(next_lp.shape[0], 1), next_lp[:, :-1]], dim=1)


def token_logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities of ``input_ids`` under a megatron ``GPTModel`` (any TP size).

    Args:
        model: GPTModel (or a megatron DDP wrapper of one) on the last pipeline stage.
        input_ids: ``[B, S]`` int64, right-padded.
    Returns:
        ``[B, S]`` float32 nats; column 0 is 0; differentiable when grad is enabled.
    """
    ce = model(input_ids=input_ids, position_ids=position_ids_for(input_ids), attention_mask=None,
               labels=next_token_labels(input_ids))  # [B, S] cross entropy of the next token
    return _shift(-ce.float())


def token_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Same as :func:`token_logprobs` from precomputed vocab-parallel logits.

    Args:
        logits: ``[B, S, V/tp]`` this rank's vocab shard. NOTE: overwritten in place by
            ``vocab_parallel_cross_entropy`` when it is float32 (pass a clone to keep it).
        input_ids: ``[B, S]``.
    Returns:
        ``[B, S]`` float32 nats, column 0 = 0.
    """
    from megatron.core import tensor_parallel

    ce = tensor_parallel.vocab_parallel_cross_entropy(logits, next_token_labels(input_ids))
    return _shift(-ce.float())


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` values and 0/1 mask -> ``[B]`` row sums of ``values * mask``."""
    return (values * mask.to(values.dtype)).sum(dim=-1)


def vocab_parallel_entropy(logits: torch.Tensor, pad_columns: torch.Tensor | None = None,
                           tp_group=None) -> torch.Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` (nats) of ``softmax(logits)`` over the full vocabulary,
    from this rank's vocab shard, differentiable.

    With ``z = logits - max``: ``H = log S - (sum_v e^z_v z_v) / S`` where ``S = sum_v e^z_v``. The max
    is all-reduced (MAX, no grad: H does not depend on it); ``S`` and ``sum e^z z`` are all-reduced
    over ``tp_group`` with megatron's ``reduce_from_tensor_model_parallel_region`` (forward
    all-reduce, backward identity: every TP rank computes the same loss from the same sums, so the
    gradient of its local partial sum is the gradient of the total). Padded vocab columns
    (``pad_columns``) contribute nothing, and no ``inf``/``nan`` enters the graph (they are zeroed,
    not set to ``-inf``, so ``0 * inf`` never appears in the backward).

    Args:
        logits: ``[b, s, V/tp]`` this rank's logit columns (temperature already applied), any float
            dtype (computed in float32).
        pad_columns: ``[V/tp]`` bool, True on padded columns of this shard; None: no padding.
        tp_group: tensor-parallel process group, None (or size 1): the logits hold the whole vocab.
    Returns:
        ``[b, s]`` float32 entropy of the next-token distribution at each position (not shifted;
        see the module conventions for the shift to token alignment).
    """
    x = logits.float()
    with torch.no_grad():
        m = (x if pad_columns is None else x.masked_fill(pad_columns, float("-inf"))).amax(dim=-1)
        if tp_group is not None and tp_group.size() > 1:
            import torch.distributed as dist

            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z = x - m.unsqueeze(-1)
    if pad_columns is not None:
        z = z.masked_fill(pad_columns, 0.0)
    e = torch.exp(z)
    if pad_columns is not None:
        e = e.masked_fill(pad_columns, 0.0)
    s, ez = e.sum(dim=-1), (e * z).sum(dim=-1)
    if tp_group is not None and tp_group.size() > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        s = reduce_from_tensor_model_parallel_region(s, group=tp_group)
        ez = reduce_from_tensor_model_parallel_region(ez, group=tp_group)
    return torch.log(s) - ez / s
