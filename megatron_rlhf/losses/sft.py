"""Best-of-K supervised fine-tuning (the control of the online-RL comparisons)."""

from __future__ import annotations

import torch

from megatron_rlhf.losses._common import (aggregate, check_tokens, k3_kl, masked_mean,
                                          resolve_denominators)

__all__ = ["best_of_k_sft_loss"]


def best_of_k_sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, *,
                       selected: torch.Tensor | None = None, loss_agg: str = "token_mean",
                       ref_logprobs: torch.Tensor | None = None,
                       global_num_sequences: float | None = None,
                       global_num_tokens: float | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """NLL of the highest-reward completion of each prompt group.

    Rejection-sampling / Best-of-K SFT (Touvron et al. 2023, sec. 3.2.3; the "Best-of-2 SFT" baseline
    of Noukhovitch et al. 2024, sec. 3): ``L = agg_{i in S, t}( -logp_it )`` over the selected rows
    ``S`` (:func:`megatron_rlhf.losses.advantages.best_of_k_mask`). The default ``token_mean``
    aggregation is the usual SFT per-token NLL; the default denominators count only selected
    sequences/tokens. The trainer may instead send only the selected rows (``selected=None``).

    Args:
        logprobs: ``[B, T]`` current-policy token logprobs (nats), with grad.
        mask: ``[B, T]`` float completion mask.
        selected: ``[B]`` float/bool 0/1 row selection, or None for all rows.
        loss_agg: see ``grpo_loss`` (algorithm.loss_agg; default ``token_mean``).
        ref_logprobs: ``[B, T]`` or None (``kl/ref_*`` metrics).
        global_num_sequences: selected sequences in the whole batch (None = local selected count).
        global_num_tokens: selected tokens in the whole batch (None = local selected tokens).
    Returns:
        ``(loss, metrics)``: ``loss/total``, ``loss/nll``, ``sft/num_sequences``,
        ``sft/mean_length`` (tokens), ``kl/ref_k3``, ``kl/ref_k1``.
    Raises:
        ValueError: shapes, unknown ``loss_agg``, or nothing selected.
    """
    check_tokens("best_of_k_sft_loss", mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if selected is None:
        sel = torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)
    else:
        if selected.shape != (mask.shape[0],):
            raise ValueError(f"best_of_k_sft_loss: selected must be [B]={mask.shape[0]}; got "
                             f"{tuple(selected.shape)}")
        sel = selected.detach().to(mask.dtype)
    m = mask * sel[:, None]
    if global_num_sequences is None:
        global_num_sequences = float(sel.sum().item())
    n_seq, n_tok = resolve_denominators("best_of_k_sft_loss", m, global_num_sequences,
                                        global_num_tokens)
    nll = aggregate(-logprobs, m, loss_agg, n_seq, n_tok)
    metrics = {"loss/nll": nll.detach(), "loss/total": nll.detach(),
               "sft/num_sequences": sel.sum(),
               "sft/mean_length": m.sum() / sel.sum().clamp_min(1.0)}
    if ref_logprobs is not None:
        metrics["kl/ref_k3"] = masked_mean(k3_kl(logprobs, ref_logprobs, m), m)
        metrics["kl/ref_k1"] = masked_mean(logprobs - ref_logprobs, m)
    return nll, metrics
