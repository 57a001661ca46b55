"""Packed sequences (THD) for the learner: a micro-batch's rows back to back in one row.

A padded micro-batch is ``[b, s]`` with every row right-padded to ``s``. Packed, its rows are cut to
their real lengths ``L_i`` and concatenated into one row of ``T = round_up(sum L_i, pad_multiple)``
tokens (``pad_multiple``: the TP size under sequence parallelism, or the platform's multiple), and
megatron gets ``PackedSeqParams(qkv_format="thd", cu_seqlens_q = cu_seqlens_kv = [0, L_1, L_1+L_2,
..., T])``. The trailing pad tokens (token 0) belong to the last sequence: they come after its real
tokens, so under causal attention no real token sees them (the same argument as right padding),
and every token of the packed row lies in some segment, which megatron's THD RoPE
(``torch.split(t, seqlens)``) requires.

What megatron-core 0.16.1 does with it (read before writing this):
* ``GPTModel._preprocess`` sizes RoPE by ``max(max_seqlen_q, max_seqlen_kv)`` and builds
  ``packed_seq=True`` embeddings (``models/gpt/gpt_model.py``);
* ``Attention.forward`` squeezes q/k/v to ``[t, heads, hn]`` and applies RoPE per segment with
  ``apply_rotary_pos_emb(..., cu_seqlens=...)`` (``models/common/embeddings/rope_utils.py``
  ``_apply_rotary_pos_emb_thd``: each segment takes ``freqs[0:L_i]``, so positions restart at 0
  per sequence), then calls the core attention with ``packed_seq_params`` and reshapes its
  ``[t, np*hn]`` output to ``[t, 1, h]`` (``transformer/attention.py``);
* the core attention must keep sequences apart: TE's ``TEDotProductAttention`` (THD, varlen
  kernels) with the TE spec, :class:`megatron_rlhf.platform.local_spec.SDPACoreAttention` (the
  block-diagonal causal mask of :func:`block_causal_mask`) without TE and on CPU.

Position ids passed to the model restart per sequence too (used only by learned absolute
position embeddings; Llama-family models use RoPE, which takes positions from ``cu_seqlens``).
Source: NeMo-RL ``nemo_rl/models/megatron/common.py`` (``_pack_sequences_for_megatron``: rows cut to
their lengths and concatenated into ``[1, T]``, ``cu_seqlens`` / ``max_seqlen``,
``PackedSeqParams(qkv_format="thd")``; with ``pad_packed_seq_to`` the padding joins the last
sequence, as here; ``_unpack_sequences_from_megatron`` copies each row's values back to
``[B, S]``); verl's ``preprocess_packed_seqs`` / ``postprocess_packed_seqs`` do the same. We pad
once at the end, not per sequence: per-sequence padding to ``2 * cp`` is for context parallelism,
which this learner does not use.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

__all__ = ["PackedRows", "packed_cu_seqlens", "pack_rows", "unpack_rows", "block_causal_mask"]


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def packed_cu_seqlens(lengths, pad_multiple: int = 1) -> list[int]:
    """Cumulative segment boundaries of a packed row: ``[0, L_1, L_1+L_2, ..., T]`` with
    ``T = round_up(sum L_i, pad_multiple)`` (the pad joins the last segment).

    Args:
        lengths: real length of each row (>= 1 each), in packing order.
        pad_multiple: the packed row's length is a multiple of this (>= 1).
    Returns:
        ``len(lengths) + 1`` ints.
    Raises:
        ValueError: no rows, a length < 1, or ``pad_multiple < 1``.
    """
    lengths = [int(v) for v in lengths]
    if not lengths or min(lengths) < 1 or pad_multiple < 1:
        raise ValueError(f"packed_cu_seqlens: lengths={lengths}, pad_multiple={pad_multiple}; "
                         "need at least one row, every length >= 1, pad_multiple >= 1")
    cu = [0, *itertools.accumulate(lengths)]
    cu[-1] = _round_up(cu[-1], pad_multiple)
    return cu


@dataclass
class PackedRows:
    """One micro-batch packed into a single row.

    Attributes:
        input_ids: ``[1, T]`` int64 (on the model's device): rows cut to their real lengths,
            back to back, then token 0 up to ``T``.
        position_ids: ``[1, T]`` int64, restarting at 0 at every sequence start.
        cu_seqlens: ``[n + 1]`` int32 on the same device (:func:`packed_cu_seqlens`).
        lengths: the ``n`` real lengths (the unpacked rows' columns ``0 .. L_i - 1``).
        max_seqlen: longest segment (the last one includes the pad).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    max_seqlen: int
    _params: object = field(default=None, repr=False, compare=False)

    def params(self):
        """megatron's ``PackedSeqParams`` for ``GPTModel.forward(packed_seq_params=...)``
        (``qkv_format="thd"``, the same boundaries for queries and keys: self-attention). The same
        object on every call, so what a core attention caches on it (the SDPA mask) is built once
        per micro-batch, not once per layer."""
        if self._params is None:
            from megatron.core.packed_seq_params import PackedSeqParams

            self._params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens,
                                           cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=self.max_seqlen,
                                           max_seqlen_kv=self.max_seqlen)
        return self._params


def pack_rows(input_ids: torch.Tensor, lengths, pad_multiple: int = 1, device=None) -> PackedRows:
    """Pack the rows of a right-padded micro-batch.

    Args:
        input_ids: ``[b, s]`` int64, row i's real tokens in columns ``0 .. lengths[i] - 1``.
        lengths: ``b`` real lengths (``<= s`` each).
        pad_multiple: see :func:`packed_cu_seqlens`.
        device: where the packed tensors go (default: ``input_ids``' device).
    Returns:
        :class:`PackedRows` with ``T = round_up(sum(lengths), pad_multiple)``.
    Raises:
        ValueError: ``len(lengths) != b`` or a length outside ``[1, s]``.
    """
    b, s = input_ids.shape
    lengths = tuple(int(v) for v in lengths)
    if len(lengths) != b or any(not 1 <= v <= s for v in lengths):
        raise ValueError(f"pack_rows: lengths {lengths} must be {b} values in [1, {s}]")
    cu = packed_cu_seqlens(lengths, pad_multiple)
    total = cu[-1]
    ids = torch.zeros(1, total, dtype=torch.long)
    pos = torch.zeros(1, total, dtype=torch.long)
    cpu_ids = input_ids.cpu()
    for i, n in enumerate(lengths):
        ids[0, cu[i]:cu[i] + n] = cpu_ids[i, :n]
        pos[0, cu[i]:cu[i + 1]] = torch.arange(cu[i + 1] - cu[i])
    device = input_ids.device if device is None else device
    seg = [cu[i + 1] - cu[i] for i in range(b)]
    return PackedRows(input_ids=ids.to(device), position_ids=pos.to(device),
                      cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                      lengths=lengths, max_seqlen=max(seg))


def unpack_rows(packed: torch.Tensor, packed_rows: PackedRows, seq_len: int) -> torch.Tensor:
    """Token-aligned per-token values of the packed row back to the padded ``[b, seq_len]`` layout.

    ``packed`` follows the token convention of :mod:`megatron_rlhf.learner.logprobs` (column t is
    the value for token t given the tokens before it, as the shifted logprobs are). Row i gets
    ``packed[0, cu_i + t]`` at columns ``1 <= t < L_i``; column 0 (a sequence start: no previous
    token; packed, it would hold the previous sequence's last position) and columns ``>= L_i``
    (padding, never inside a loss mask) are 0. Differentiable (a gather).

    Args:
        packed: ``[1, T]`` (or ``[T]``) float values on the packed row.
        packed_rows: the packing that produced the row.
        seq_len: columns of the padded micro-batch (``>= max L_i``).
    Returns:
        ``[b, seq_len]`` same dtype and device as ``packed``.
    """
    flat = packed.reshape(-1)
    lengths = torch.tensor(packed_rows.lengths, device=flat.device)
    starts = packed_rows.cu_seqlens[:-1].to(device=flat.device, dtype=torch.long)
    cols = torch.arange(seq_len, device=flat.device)
    valid = (cols.unsqueeze(0) >= 1) & (cols.unsqueeze(0) < lengths.unsqueeze(1))
    idx = torch.where(valid, starts.unsqueeze(1) + cols.unsqueeze(0), torch.zeros_like(valid, dtype=torch.long))
    return torch.where(valid, flat[idx], flat.new_zeros(()))


def block_causal_mask(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Block-diagonal causal attention mask of a packed row, megatron convention (True = masked).

    Query i may attend key j iff both lie in the same segment ``[cu_k, cu_{k+1})`` and ``j <= i``.
    Built with tensor ops on ``cu_seqlens``' device (no host sync), so it is the same code on CPU
    and CUDA.

    Args:
        cu_seqlens: ``[n + 1]`` int boundaries, ``cu_seqlens[0] = 0``, ``cu_seqlens[-1] = T``.
        total: ``T`` (default ``int(cu_seqlens[-1])``, which syncs with the device).
    Returns:
        ``[T, T]`` bool.
    """
    t = int(cu_seqlens[-1]) if total is None else int(total)
    pos = torch.arange(t, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens[1:].to(torch.long), pos, right=True)   # segment of each token
    allowed = (seg.unsqueeze(1) == seg.unsqueeze(0)) & (pos.unsqueeze(0) <= pos.unsqueeze(1))
    return ~allowed
