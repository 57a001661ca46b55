"""Mistral (``MistralForCausalLM``) mapping table: the Llama tensors under the same names.

Mistral differs from Llama only in attention scope: ``sliding_window`` (Mistral-7B-v0.1: 4096;
v0.2+ and most later models: null). The weights convert identically; megatron's CPU/SDPA
attention here is full causal attention, so a window shorter than the sequences you train on
changes the model. :func:`validate_mistral` therefore logs a warning when
``sliding_window < max_position_embeddings`` (results are identical for sequences of at most
``sliding_window`` tokens) instead of refusing the checkpoint.
Source: transformers ``models/mistral/modeling_mistral.py``.
"""

from __future__ import annotations

import logging

from megatron_rlhf.convert.llama import LLAMA_RULES, validate_no_linear_bias
from megatron_rlhf.convert.rules import ArchSpec

__all__ = ["MISTRAL", "validate_mistral"]

log = logging.getLogger(__name__)


def validate_mistral(hf_config) -> None:
    """No linear biases; warn when a sliding window is shorter than the context.

    Raises:
        ValueError: ``attention_bias`` / ``mlp_bias`` set.
    """
    validate_no_linear_bias(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < hf_config.max_position_embeddings:
        log.warning("mistral sliding_window=%d < max_position_embeddings=%d: the megatron model "
                    "attends to the full context; logits match transformers only for sequences of "
                    "at most %d tokens", window, hf_config.max_position_embeddings, window)


MISTRAL = ArchSpec(name="mistral", model_types=("mistral",), rules=LLAMA_RULES,
                   validate=validate_mistral)
