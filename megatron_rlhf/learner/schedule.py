"""Run micro-batches through a (possibly pipelined) megatron GPTModel and turn the last stage's
output into token log-probabilities, with an arbitrary per-micro-batch loss on top.

    run_microbatches(model, mbs, on_logprobs, forward_only=False, pp=2, pg_collection=pg, vocab=...)

* PP > 1: megatron-core's ``get_forward_backward_func`` (1F1B without interleaving) with
  ``config.variable_seq_lengths = True``, so micro-batches of different lengths and row counts
  cross the pipeline (p2p sends the shape first). PP = 1: the same forward/loss/backward sequence
  as megatron's ``forward_backward_no_pipelining`` in a plain loop (that schedule allocates
  ``device="cuda"`` counters, which on CPU would need the global CUDA->CPU torch-function mode and
  its ~15 % forward overhead).
* Token logprobs never gather the vocab: the last stage computes ``vocab_parallel_cross_entropy``
  on its ``[b, s, V/tp]`` logits (megatron-core 0.16.1 ``tensor_parallel/cross_entropy.py``; only
  ``[b, s]`` max / sum-exp / target logit are all-reduced over TP). When the vocab was padded for
  TP (:func:`megatron_rlhf.convert.sharding.padded_vocab_size`) the padded columns are set to
  ``-inf`` first, so they carry no probability mass and the result equals the unpadded model.
* Sampling temperature: with ``temperature != 1`` the logprobs are those of ``softmax(logits /
  temperature)``, the distribution vLLM samples from (each rank scales its own ``V/tp`` logit
  columns before the vocab-parallel cross entropy, so nothing is gathered). The model is then
  called without labels and returns its vocab-parallel logits, as with vocab padding.
* ``with_entropy``: also the per-token entropy of that distribution, differentiable and
  vocab-parallel (:func:`megatron_rlhf.learner.logprobs.vocab_parallel_entropy`), aligned like the
  token logprobs.
* Packed micro-batches (``learner.pack_sequences``; :mod:`megatron_rlhf.learner.packing`): a
  micro-batch built with ``pack_lengths`` runs as one row of ``sum(L_i)`` tokens (rounded up to the
  pad multiple) with ``PackedSeqParams`` (THD); its token logprobs and entropies are unpacked back to
  the padded ``[b, s]`` layout before ``on_logprobs`` sees them (columns past a row's real length
  are 0 instead of the padded forward's values there; no loss mask reaches them), so losses,
  masks and denominators are those of the padded run.
* ``on_logprobs(k, mb, tok_lp)`` (``on_logprobs(k, mb, tok_lp, entropy)`` with ``with_entropy``)
  runs on the last pipeline stage only and returns the loss of micro-batch k (a scalar tensor).
  Like megatron's schedules, the loss is divided by the number of micro-batches before backward;
  callers scale accordingly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_rlhf.learner.logprobs import (_shift, next_token_labels, position_ids_for,
                                            vocab_parallel_entropy)
from megatron_rlhf.learner.packing import PackedRows, pack_rows, unpack_rows

__all__ = ["MicroBatchData", "run_microbatches", "run_schedule", "make_microbatch", "cut_rows"]


@dataclass
class MicroBatchData:
    """Tensors of one micro-batch.

    Attributes:
        input_ids: ``[b, s]`` int64 on the model's device (right-padded, cut to the micro-batch length).
        rows: row indices of these sequences in the full batch.
        loss_mask: ``[b, s]`` float32 CPU (completion tokens = 1), or None.
        extra: any per-micro-batch data the loss needs (e.g. reference logprobs).
        packed: the same rows packed into one row (:class:`~megatron_rlhf.learner.packing.PackedRows`):
            :func:`run_microbatches` then runs the packed row; None: the padded ``input_ids``.
            (The critic's value schedule always runs the padded ``input_ids``.)
    """

    input_ids: torch.Tensor
    rows: tuple[int, ...]
    loss_mask: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
    packed: PackedRows | None = None


def cut_rows(t: torch.Tensor, rows, seq_len: int, fill=0) -> torch.Tensor:
    """Rows ``rows`` of a ``[B, S, ...]`` tensor cut (or right-padded with ``fill``) to ``seq_len``
    columns: ``[len(rows), seq_len, ...]``."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=t.device)
    t = t.index_select(0, idx)[:, :seq_len]
    if t.shape[1] < seq_len:
        t = torch.cat([t, t.new_full((t.shape[0], seq_len - t.shape[1], *t.shape[2:]), fill)], dim=1)
    return t


def make_microbatch(input_ids: torch.Tensor, rows, seq_len: int, device, loss_mask=None, *,
                    pack_lengths=None, pad_multiple: int = 1, **extra) -> MicroBatchData:
    """Cut rows ``rows`` of ``input_ids [B, S]`` (and of ``loss_mask``/``extra`` ``[B, S]`` tensors)
    to ``seq_len`` columns; columns beyond ``S`` are filled with token 0 / mask 0 (right padding,
    invisible to the causal logprobs of earlier tokens).

    ``pack_lengths``: the real length of each of ``rows`` (:func:`~megatron_rlhf.learner.batching.row_lengths`):
    the micro-batch also gets its packed form (``packed``, a row of ``round_up(sum, pad_multiple)``
    tokens on ``device``), which :func:`run_microbatches` runs instead of the padded rows.
    Raises ValueError (from :func:`~megatron_rlhf.learner.packing.pack_rows`) for lengths outside
    ``[1, seq_len]``."""
    ids = cut_rows(input_ids, rows, seq_len, 0)
    return MicroBatchData(
        input_ids=ids.to(device), rows=tuple(rows),
        loss_mask=None if loss_mask is None else cut_rows(loss_mask, rows, seq_len, 0.0),
        extra={k: (cut_rows(v, rows, seq_len, 0.0) if torch.is_tensor(v) and v.dim() == 2 else v)
               for k, v in extra.items()},
        packed=None if pack_lengths is None else pack_rows(ids, pack_lengths, pad_multiple, device))


def _pad_columns(vocab_size: int, padded_vocab: int, tp_rank: int, tp: int) -> torch.Tensor | None:
    """``[V/tp]`` bool mask of this rank's padded vocab columns, or None when it has none."""
    if padded_vocab == vocab_size:
        return None
    per = padded_vocab // tp
    pad = torch.arange(tp_rank * per, (tp_rank + 1) * per) >= vocab_size
    return pad if bool(pad.any()) else None


def _token_logprobs_from_output(output: torch.Tensor, input_ids: torch.Tensor, *, from_logits: bool,
                                pad: torch.Tensor | None, temperature: float = 1.0,
                                with_entropy: bool = False, tp_group=None):
    """Last-stage model output -> (``[b, s]`` float32 token logprobs (column 0 = 0), ``[b, s]``
    entropy aligned like them or None).

    ``output`` is the per-token cross entropy ``[b, s]`` (model called with labels;
    ``from_logits=False``) or the vocab-parallel logits ``[b, s, V/tp]``: then the logits are
    divided by ``temperature``, padded columns (``pad``) set to -inf, and megatron's
    ``vocab_parallel_cross_entropy`` gives the logprobs (it overwrites its input, so it gets a
    tensor of its own when the entropy also needs the logits).
    """
    if not from_logits:
        return _shift(-output.float()), None
    from megatron.core import tensor_parallel

    logits = output.float()
    if temperature != 1.0:
        logits = logits / temperature
    ce_in = logits if pad is None else logits.masked_fill(pad.to(logits.device), float("-inf"))
    if with_entropy and ce_in is logits:
        ce_in = logits.clone()
    ce = tensor_parallel.vocab_parallel_cross_entropy(ce_in, next_token_labels(input_ids))
    ent = None
    if with_entropy:
        ent = _shift(vocab_parallel_entropy(logits, None if pad is None else pad.to(logits.device),
                                            tp_group))
    return _shift(-ce.float()), ent


def run_microbatches(model, mbs: list[MicroBatchData],
                     on_logprobs: Callable[..., torch.Tensor | None],
                     *, forward_only: bool, pp: int, pg_collection, vocab_size: int,
                     padded_vocab: int, tp_rank: int = 0, tp: int = 1, no_sync=None,
                     temperature: float = 1.0, with_entropy: bool = False) -> None:
    """Forward (and backward unless ``forward_only``) every micro-batch of ``mbs`` in order.

    Args:
        model: GPTModel or megatron DDP of one (this rank's pipeline stage).
        mbs: this rank's micro-batches (every stage of a pipeline gets the same list).
        on_logprobs: ``(k, mb, tok_lp [b, s]) -> scalar loss`` (with ``with_entropy`` also a fourth
            argument, the ``[b, s]`` entropy) called on the last stage for micro-batch k; with
            ``forward_only`` its return value is ignored (may be None).
        forward_only: no backward (and ``torch.no_grad``).
        pp: pipeline size; pg_collection: megatron ``ProcessGroupCollection`` of this rank.
        vocab_size, padded_vocab, tp_rank, tp: see module doc (vocab padding mask).
        no_sync: context-manager factory that defers DP grad reduction (megatron DDP's ``no_sync``;
            used for all but the last micro-batch when grad-reduce overlap is on), or None.
        temperature: logprobs (and entropy) of ``softmax(logits / temperature)`` (> 0).
        with_entropy: compute the per-token entropy (differentiable) and pass it to ``on_logprobs``.
    Raises:
        ValueError: ``mbs`` is empty or ``temperature <= 0``.
    """
    if not mbs:
        raise ValueError("run_microbatches: no micro-batch given")
    if not temperature > 0:
        raise ValueError(f"run_microbatches: temperature must be > 0; got {temperature}")
    pad = _pad_columns(vocab_size, padded_vocab, tp_rank, tp)
    from_logits = padded_vocab != vocab_size or temperature != 1.0 or with_entropy
    tp_group = pg_collection.tp if tp > 1 else None

    def forward_step(data_iterator, m):
        k, mb = next(data_iterator)
        packed = mb.packed
        if packed is None:
            ids = mb.input_ids
            kwargs = dict(input_ids=ids, position_ids=position_ids_for(ids), attention_mask=None)
        else:
            ids = packed.input_ids
            kwargs = dict(input_ids=ids, position_ids=packed.position_ids, attention_mask=None,
                          packed_seq_params=packed.params())
        if not from_logits:
            kwargs["labels"] = next_token_labels(ids)
        output = m(**kwargs)

        def loss_func(out):
            tok, ent = _token_logprobs_from_output(out, ids, from_logits=from_logits, pad=pad,
                                                   temperature=temperature,
                                                   with_entropy=with_entropy, tp_group=tp_group)
            if packed is not None:   # back to the padded [b, s] layout the losses index
                s = mb.input_ids.shape[1]
                tok = unpack_rows(tok, packed, s)
                ent = None if ent is None else unpack_rows(ent, packed, s)
            loss = on_logprobs(k, mb, tok, ent) if with_entropy else on_logprobs(k, mb, tok)
            if loss is None or forward_only:
                loss = tok.sum() * 0.0
            return loss, {}

        return output, loss_func

    run_schedule(model, mbs, forward_step, forward_only=forward_only, pp=pp,
                 pg_collection=pg_collection, no_sync=no_sync, caller="run_microbatches")


def run_schedule(model, mbs: list, forward_step, *, forward_only: bool, pp: int, pg_collection,
                 no_sync=None, caller: str = "run_schedule") -> None:
    """Drive megatron's ``forward_step(data_iterator, model) -> (output, loss_func)`` over the
    micro-batches ``mbs`` (the iterator yields ``(k, mb)``): PP > 1 through megatron-core's
    ``get_forward_backward_func`` (1F1B, ``variable_seq_lengths``); PP = 1 the same
    forward / loss / ``(loss / n).backward()`` sequence in a plain loop (module doc).

    Raises:
        ValueError: PP > 1 without ``TransformerConfig.variable_seq_lengths`` (names ``caller``).
    """
    n = len(mbs)
    data = iter(list(enumerate(mbs)))
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_ctx:
        if pp == 1:
            for k in range(n):
                sync_ctx = no_sync() if (no_sync is not None and not forward_only and k < n - 1) \
                    else contextlib.nullcontext()
                with sync_ctx:
                    out, loss_func = forward_step(data, model)
                    loss, _ = loss_func(out)
                    if not forward_only:
                        (loss / n).backward()
            return
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        config = getattr(model, "module", model).config
        if not config.variable_seq_lengths:
            raise ValueError(f"{caller}: PP > 1 needs TransformerConfig.variable_seq_lengths=True")
        fb = get_forward_backward_func(pp_size=pp)
        fb(forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=n,
           seq_length=max(mb.input_ids.shape[1] for mb in mbs),
           micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs), forward_only=forward_only,
           p2p_communicator=P2PCommunicator(pp_group=pg_collection.pp, config=config),
           pg_collection=pg_collection)
