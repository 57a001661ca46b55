"""Length-grouped micro-batches for variable-length learner batches (pure functions, no torch.distributed).

A learner batch is ``[B, S]`` right-padded to its longest row. Running every micro-batch at ``S``
wastes compute on padding, so rows are sorted by their real length, split across data-parallel
ranks, and grouped into micro-batches that are each cut to their own longest row:

* the real length of a row is ``last position with loss_mask = 1`` + 1: for a causal LM the
  logprob of token t depends only on tokens <= t, so dropping the columns after the last
  completion token changes no masked logprob (exact, not an approximation);
* a *unit* is a run of consecutive rows that must stay in one micro-batch because its loss needs
  all of them: a DPO pair (rows 2i and 2i+1), a GroupDPO prompt group (all rows with one
  ``group_id``, :func:`unit_sizes`), or a single row for losses whose rows are independent once
  the batch's advantages are computed (GRPO, PPO, RLOO, best-of-K SFT);
* units are sorted longest first and dealt round-robin over DP ranks, so ranks get equal unit
  counts (+-1) and similar token loads; each rank packs its units greedily, in that order, into
  micro-batches of at most ``rows_per_microbatch`` rows, or, with a token budget
  (``learner.max_tokens_per_microbatch``), of at most ``max_tokens`` slots (rows x the
  micro-batch's padded length; the first unit of a micro-batch is its longest, so short rows share
  a micro-batch and long ones get few companions); a unit larger than the cap runs alone;
* a micro-batch's length is rounded up to ``pad_multiple`` (the TP size under sequence
  parallelism, which splits the sequence over TP ranks).

* packed (``learner.pack_sequences``, ``packed=True``): a micro-batch runs as one row of its rows'
  real lengths back to back (:mod:`megatron_rlhf.learner.packing`), rounded up once to
  ``pad_multiple``; the token budget then counts those packed slots, so more short rows share a
  micro-batch.

``padding_fraction`` = padded token slots / all token slots over all micro-batches of all DP
ranks (reported as ``batch/padding_fraction``; packed, only the rounding of each packed row).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "row_lengths", "unit_sizes", "plan_microbatches", "padding_fraction"]


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the batch that run together, cut to ``seq_len`` columns.

    Attributes:
        rows: row indices into the ``[B, S]`` batch (a unit's rows are adjacent and in batch
            order: a pair's chosen, then rejected).
        seq_len: columns to run (>= every row's real length; a multiple of ``pad_multiple``; may
            exceed ``S`` by less than ``pad_multiple``: the extra columns are filled with token 0).
        packed_len: 0 (padded), or the length of the packed row the micro-batch runs as
            (``sum`` of its rows' real lengths rounded up to ``pad_multiple``).
    """

    rows: tuple[int, ...]
    seq_len: int
    packed_len: int = 0

    @property
    def slots(self) -> int:
        """Token slots the model runs: ``packed_len`` when packed, else ``rows x seq_len``."""
        return self.packed_len or len(self.rows) * self.seq_len


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


def unit_sizes(group_ids) -> list[int]:
    """Sizes of the runs of equal ``group_ids``: the units of a batch whose groups stay together.

    Args:
        group_ids: ``[B]`` integer unit id of each row (``LearnerBatch.group_ids``).
    Returns:
        run lengths, in row order (they sum to ``B``).
    Raises:
        ValueError: a group's rows are not contiguous (``LearnerBatch.from_groups`` always
            writes them contiguously).
    """
    ids = [int(v) for v in torch.as_tensor(group_ids).reshape(-1).tolist()]
    sizes: list[int] = []
    seen: set[int] = set()
    for k, g in enumerate(ids):
        if k and g == ids[k - 1]:
            sizes[-1] += 1
            continue
        if g in seen:
            raise ValueError(f"unit_sizes: rows of group {g} are not contiguous (row {k}); a group's "
                             "rows must be adjacent (build batches with LearnerBatch.from_groups)")
        seen.add(g)
        sizes.append(1)
    return sizes


def plan_microbatches(lengths: list[int], *, rows_per_microbatch: int, dp_rank: int = 0,
                      dp_size: int = 1, pairs: bool = True, pad_multiple: int = 1,
                      units: list[int] | None = None, max_tokens: int = 0,
                      packed: bool = False) -> list[MicroBatch]:
    """Micro-batches of DP rank ``dp_rank`` (see module doc).

    Args:
        lengths: real length of each of the ``B`` rows (:func:`row_lengths`).
        rows_per_microbatch: most rows per micro-batch (``learner.micro_batch_size``); a unit
            with more rows gets a micro-batch of its own.
        dp_rank, dp_size: this rank and the data-parallel size.
        pairs: without ``units``: keep rows 2i and 2i+1 together (DPO); False: every row is a unit.
        pad_multiple: round each micro-batch length up to a multiple of this.
        units: sizes of consecutive units (e.g. :func:`unit_sizes`); overrides ``pairs``.
        max_tokens: token budget of a micro-batch (0: off); when set it replaces
            ``rows_per_microbatch``: a micro-batch takes units while ``rows x padded length`` stays
            within it (a unit over the budget by itself runs alone).
        packed: the micro-batches run packed: the budget counts ``round_up(sum of the rows' real
            lengths, pad_multiple)`` instead of ``rows x padded length``, and each micro-batch's
            ``packed_len`` is set.
    Returns:
        this rank's micro-batches, longest first; empty when the rank gets no unit.
    Raises:
        ValueError: ``pairs`` with an odd number of rows, ``units`` not summing to ``B``, or bad sizes.
    """
    n = len(lengths)
    if rows_per_microbatch < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size or pad_multiple < 1 \
            or max_tokens < 0:
        raise ValueError(f"plan_microbatches: rows_per_microbatch={rows_per_microbatch}, "
                         f"dp_rank={dp_rank}, dp_size={dp_size}, pad_multiple={pad_multiple}, "
                         f"max_tokens={max_tokens}")
    if units is None:
        if pairs and n % 2:
            raise ValueError(f"plan_microbatches: {n} rows cannot form DPO pairs (need an even count)")
        units = [2 if pairs else 1] * (n // 2 if pairs else n)
    if sum(units) != n or any(u < 1 for u in units):
        raise ValueError(f"plan_microbatches: unit sizes {units} must be >= 1 and sum to the {n} rows")
    starts = [0, *itertools.accumulate(units)][:-1]
    rows_of = [tuple(range(a, a + w)) for a, w in zip(starts, units)]
    ulen = [max(lengths[r] for r in u) for u in rows_of]
    usum = [sum(lengths[r] for r in u) for u in rows_of]
    order = sorted(range(len(rows_of)), key=lambda u: (-ulen[u], u))  # longest first, stable
    def fits(chunk: list[int], u: int) -> bool:
        rows = sum(units[v] for v in chunk) + units[u]
        if not max_tokens:
            return rows <= rows_per_microbatch
        if packed:
            return _round_up(sum(usum[v] for v in (*chunk, u)), pad_multiple) <= max_tokens
        return rows * _round_up(max(ulen[v] for v in (*chunk, u)), pad_multiple) <= max_tokens

    chunks: list[list[int]] = []
    for u in order[dp_rank::dp_size]:
        if chunks and fits(chunks[-1], u):
            chunks[-1].append(u)
        else:
            chunks.append([u])
    return [MicroBatch(rows=tuple(r for u in chunk for r in rows_of[u]),
                       seq_len=_round_up(max(ulen[u] for u in chunk), pad_multiple),
                       packed_len=_round_up(sum(usum[u] for u in chunk), pad_multiple) if packed else 0)
            for chunk in chunks]


def padding_fraction(lengths: list[int], plans: list[list[MicroBatch]]) -> float:
    """Padded slots / all slots over the micro-batches of all DP ranks (``plans[d]`` = rank d's).

    A slot is one (row, column) the model runs (:attr:`MicroBatch.slots`: one token of the
    packed row when packed); a row's real slots are ``lengths[row]``. Returns 0.0 for an empty plan.
    """
    total = sum(mb.slots for plan in plans for mb in plan)
    real = sum(lengths[r] for plan in plans for mb in plan for r in mb.rows)
    return 0.0 if total == 0 else 1.0 - real / total
