"""Model FLOPs of the learner and the per-step throughput metrics (``perf/*``).

Model FLOPs (what MFU counts; recomputation and padding are not useful work), per the PaLM
convention (Chowdhery et al. 2022, appendix B; the same matmul count as Narayanan et al. 2021,
sec. 5.1): a forward pass over a token in a sequence of length T costs

    F(T) = 2 * N + 4 * L * H * Q * T

with N = L * (h*Q*(H + 2G) + H*Q*h + 3*h*f) + h*V the matmul parameters (QKV with G KV groups,
output projection, SwiGLU gate/up/down, LM head; the embedding lookup is free), L layers, H query
heads of size Q, hidden h, FFN f, vocab V; 4*L*H*Q*T is QK^T plus AV (full, not halved for the
causal mask). A forward + backward costs 3 F(T). ``bench/learner.py`` counts its steps with the
same function.
"""

from __future__ import annotations

__all__ = ["model_flops_per_token", "batch_model_flops", "throughput_metrics"]


def model_flops_per_token(hf, seq_len: int) -> float:
    """Forward FLOPs of one token in a sequence of ``seq_len`` tokens (module doc).

    Args:
        hf: an HF config with ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
            ``vocab_size``, ``num_attention_heads`` (and optionally ``num_key_value_heads``,
            ``head_dim``).
        seq_len: the sequence's real length T (tokens).
    Returns:
        FLOPs (float).
    """
    h, L, f, V = hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size, hf.vocab_size
    H = hf.num_attention_heads
    G = getattr(hf, "num_key_value_heads", None) or H
    Q = getattr(hf, "head_dim", None) or h // H
    n = L * (h * Q * (H + 2 * G) + H * Q * h + 3 * h * f) + h * V
    return 2.0 * n + 4.0 * L * H * Q * seq_len


def batch_model_flops(hf, lengths: list[int], forward_passes: float) -> float:
    """Model FLOPs of ``forward_passes`` forward-equivalents over rows of real ``lengths``:
    ``forward_passes * sum_rows T * F(T)`` (a forward + backward is 3 forward-equivalents)."""
    return forward_passes * sum(n * model_flops_per_token(hf, n) for n in lengths if n > 0)


def throughput_metrics(hf, lengths: list[int], forward_passes: float, seconds: float, num_ranks: int,
                       peak_tflops_per_device: float | None) -> dict[str, float]:
    """The ``perf/*`` metrics of one learner step.

    Args:
        hf: the policy's HF config (:func:`model_flops_per_token`).
        lengths: real token count (prompt + completion, padding excluded) of every row of the batch.
        forward_passes: forward-equivalents the step ran on every row (3 per optimizer update, 1
            per forward-only pass: reference, pi_old recompute, mismatch pass).
        seconds: the step's wall time (``time/train_s``).
        num_ranks: learner ranks (devices), TP x PP x DP.
        peak_tflops_per_device: dense peak of one device (``platform.peaks``), or None (CPU, or
            an unknown GPU: no ``perf/mfu``).
    Returns:
        ``perf/learner_tokens_per_s`` (real tokens of the batch per second, all ranks),
        ``perf/learner_tokens_per_s_per_rank`` (that / ranks), ``perf/learner_tflops`` (model
        TFLOP/s, all ranks), ``perf/learner_tflops_per_rank``, and ``perf/mfu`` = model FLOP/s /
        (peak x ranks) when the peak is known.
    """
    secs = max(float(seconds), 1e-9)
    tokens = float(sum(n for n in lengths if n > 0))
    tflops = batch_model_flops(hf, lengths, forward_passes) / secs / 1e12
    out = {"perf/learner_tokens_per_s": tokens / secs,
           "perf/learner_tokens_per_s_per_rank": tokens / secs / num_ranks,
           "perf/learner_tflops": tflops, "perf/learner_tflops_per_rank": tflops / num_ranks}
    if peak_tflops_per_device:
        out["perf/mfu"] = tflops / (peak_tflops_per_device * num_ranks)
    return out
