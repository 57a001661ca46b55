"""Length-grouped micro-batches for variable-length learner batches (pure functions, no torch.distributed).

A learner batch is ``[B, S]`` right-padded to its longest row. Running every micro-batch at ``S``
wastes compute on padding, so rows are sorted by their real length, split across data-parallel
ranks, and grouped into micro-batches that are each cut to their own longest row:

* the real length of a row is ``last position with loss_mask = 1`` + 1: for a causal LM the
  logprob of token t depends only on tokens <= t, so dropping the columns after the last
  completion token changes no masked logprob (exact, not an approximation);
* DPO pairs (rows 2i and 2i+1) stay in one micro-batch (the loss of a pair needs both rows);
* units (pairs or rows) are sorted longest first and dealt round-robin over DP ranks, so ranks
  get equal counts (+-1) and similar token loads; each rank cuts its units into micro-batches of
  ``rows_per_microbatch`` rows;
* a micro-batch's length is rounded up to ``pad_multiple`` (the TP size under sequence
  parallelism, which splits the sequence over TP ranks).

``padding_fraction`` = padded token slots / all token slots over all micro-batches of all DP
ranks (reported as ``batch/padding_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "row_lengths", "plan_microbatches", "padding_fraction"]


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the batch that run together, cut to ``seq_len`` columns.

    Attributes:
        rows: row indices into the ``[B, S]`` batch (a pair's rows are adjacent: chosen, rejected).
        seq_len: columns to run (>= every row's real length; a multiple of ``pad_multiple``; may
            exceed ``S`` by less than ``pad_multiple``: the extra columns are filled with token 0).
    """

    rows: tuple[int, ...]
    seq_len: int


def row_lengths(loss_mask: torch.Tensor | None, seq_len: int, num_rows: int) -> list[int]:
    """Real length of every row: last index with ``loss_mask > 0`` plus one (at least 1).

    Args:
        loss_mask: ``[B, S]`` 0/1 mask, or None (then every row counts as ``seq_len`` long, as for
            :meth:`MegatronLearner.token_logprobs`, which returns every column).
        seq_len: ``S``; num_rows: ``B`` (used when ``loss_mask`` is None).
    Returns:
        ``B`` ints in ``[1, S]``.
    """
    if loss_mask is None:
        return [int(seq_len)] * int(num_rows)
    m = torch.as_tensor(loss_mask) > 0
    idx = torch.arange(1, m.shape[1] + 1).expand_as(m)
    return [max(1, int(v)) for v in (idx * m).amax(dim=1).tolist()]


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def plan_microbatches(lengths: list[int], *, rows_per_microbatch: int, dp_rank: int = 0,
                      dp_size: int = 1, pairs: bool = True, pad_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches of DP rank ``dp_rank`` (see module doc).

    Args:
        lengths: real length of each of the ``B`` rows (:func:`row_lengths`).
        rows_per_microbatch: rows per micro-batch (``learner.micro_batch_size``); with ``pairs``
            rounded down to an even number, at least 2.
        dp_rank, dp_size: this rank and the data-parallel size.
        pairs: keep rows 2i and 2i+1 together (DPO); False: rows are independent units.
        pad_multiple: round each micro-batch length up to a multiple of this.
    Returns:
        this rank's micro-batches, longest first; empty when the rank gets no unit.
    Raises:
        ValueError: ``pairs`` with an odd number of rows, or bad sizes.
    """
    n = len(lengths)
    if pairs and n % 2:
        raise ValueError(f"plan_microbatches: {n} rows cannot form DPO pairs (need an even count)")
    if rows_per_microbatch < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size or pad_multiple < 1:
        raise ValueError(f"plan_microbatches: rows_per_microbatch={rows_per_microbatch}, "
                         f"dp_rank={dp_rank}, dp_size={dp_size}, pad_multiple={pad_multiple}")
    width = 2 if pairs else 1
    units = [tuple(range(u * width, (u + 1) * width)) for u in range(n // width)]
    ulen = [max(lengths[r] for r in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-ulen[u], u))  # longest first, stable
    mine = order[dp_rank::dp_size]
    per_mb = max(1, rows_per_microbatch // width)
    out = []
    for k in range(0, len(mine), per_mb):
        chunk = mine[k:k + per_mb]
        rows = tuple(r for u in chunk for r in units[u])
        out.append(MicroBatch(rows=rows, seq_len=_round_up(max(ulen[u] for u in chunk), pad_multiple)))
    return out


def padding_fraction(lengths: list[int], plans: list[list[MicroBatch]]) -> float:
    """Padded slots / all slots over the micro-batches of all DP ranks (``plans[d]`` = rank d's).

    A slot is one (row, column) the model runs; a row's real slots are ``lengths[row]``.
    Returns 0.0 for an empty plan.
    """
    total = sum(len(mb.rows) * mb.seq_len for plan in plans for mb in plan)
    real = sum(lengths[r] for plan in plans for mb in plan for r in mb.rows)
    return 0.0 if total == 0 else 1.0 - real / total
