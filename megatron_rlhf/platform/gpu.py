"""GPU platform: the Transformer Engine layer spec (when megatron's TE extension is live) and the
CUDA seed. Everything else the GPU learner builds is device-agnostic and lives in
:mod:`megatron_rlhf.platform.local_spec` (the same code CI runs on CPU).

Never imported on CPU (``megatron_rlhf.platform`` reaches this module only for a CUDA platform or
for the TE check). No shims: megatron-core runs natively on CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

__all__ = ["te_layer_spec", "seed", "have_transformer_engine", "have_fused_wgrad_kernel", "TransformerEngineMismatch",
           "LEARNER_CUDA_ENV", "apply_learner_cuda_env"]

log = logging.getLogger(__name__)

#: Environment of every GPU learner process, set before its CUDA context exists (review 2, N6).
#:
#: ``CUDA_DEVICE_MAX_CONNECTIONS=1``, deliberately. Megatron's tensor-parallel linear layers with
#: sequence parallelism launch the input all-gather / grad reduce-scatter asynchronously and then
#: the weight-gradient GEMM, and rely on one hardware work queue for the communication to be
#: scheduled first and overlap the GEMM (megatron-core 0.16.1 ``tensor_parallel/layers.py``
#: ``LinearWithGradAccumulationAndAsyncCommunication.backward``, which warns without it; Megatron-LM
#: and NeMo launchers set 1). The cost: with one queue, kernels of different streams serialize, so
#: on the exporter rank (TP0/DP0 of each stage) the weight-broadcast chunks of
#: ``generator/broadcast_sync.py``'s sender stream run between the train step's kernels instead of
#: beside them: the next step is delayed by about the broadcast's own time (8B: ~16 GB, ~1 s at
#: IB speed, against a train step of tens of seconds), once per publish. No deadlock: a broadcast
#: is only launched once every receiver is in it (``broadcast_sync.decide``). The TP overlap is
#: won at every layer of every micro-batch (noticeable at TP=8, the 70B recipe), so 1 wins. vLLM
#: engines do not get it (not a learner; their async output copies use a second stream). A value
#: set by the user (the job's environment, e.g. the sbatch script) is kept.
LEARNER_CUDA_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

#: megatron-core 0.16.1's own metadata (its ``dev`` extra in ``megatron_core-0.16.1.dist-info/METADATA``):
#: ``transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0``.
TE_RANGE = ">=2.9,<2.12"


class TransformerEngineMismatch(RuntimeError):
    """``transformer_engine`` imports but megatron-core's TE extension did not load it (megatron then
    replaces ``te`` with a ``MagicMock`` and would build layers over the mock)."""


def _dist_version(*names: str) -> str:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _te_import_error() -> str:
    """The error of the import megatron's TE extension does (``megatron/core/extensions/
    transformer_engine.py``: ``import transformer_engine``, then ``transformer_engine.pytorch.fp8``'s
    ``FP8GlobalStateManager`` and ``fp8_autocast``), or ``""`` when it succeeds."""
    try:
        import transformer_engine  # noqa: F401
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, fp8_autocast  # noqa: F401
    except Exception as e:  # ImportError, or OSError from a missing CUDA library
        return f"{type(e).__name__}: {e}"
    return ""


def have_transformer_engine() -> bool:
    """Whether the learner uses Transformer Engine, decided by megatron-core's own flag
    (``megatron.core.extensions.transformer_engine.HAVE_TE``), so the TE spec is never built over
    the ``MagicMock`` megatron substitutes when its TE import fails.

    Returns:
        False when no ``transformer_engine`` package is installed; True when megatron loaded it.
    Raises:
        TransformerEngineMismatch: ``transformer_engine`` is installed but megatron's TE extension
            did not load it (``HAVE_TE`` is False): the message names both packages' versions,
            the import error and the fix (a TE inside megatron-core's range, or no TE at all).
    Source: megatron-core 0.16.1 ``megatron/core/extensions/transformer_engine.py`` lines 61-77.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        from megatron.core.extensions import transformer_engine as mte
    except ImportError as e:   # megatron's fp8_utils imports TE's modules unguarded
        why = f"importing megatron-core failed: {type(e).__name__}: {e}"
    else:
        if mte.HAVE_TE:
            return True
        why = _te_import_error() or "HAVE_TE is False"
    te_v = _dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch")
    mc_v = _dist_version("megatron-core", "megatron_core")
    raise TransformerEngineMismatch(
        f"transformer_engine {te_v} is installed, but megatron-core {mc_v} could not load it "
        f"({why}); megatron would replace it with a MagicMock. "
        f"Fix: install a Transformer Engine megatron-core supports (megatron-core 0.16.1: "
        f"transformer-engine[pytorch]{TE_RANGE}, built with --no-build-isolation; "
        "tools/setup_gpu.sh), or uninstall transformer-engine to train with the device-agnostic "
        "spec (SDPA attention, torch norms)")


def have_fused_wgrad_kernel() -> bool:
    """Whether APEX's ``fused_weight_gradient_mlp_cuda`` extension imports (built with
    ``--cpp_ext --cuda_ext``; optional in ``requirements/gpu.txt``). megatron-core's own linear layers
    need it for ``gradient_accumulation_fusion`` (GPTModel's output layer is a
    ``tensor_parallel.ColumnParallelLinear`` even with the TE spec, and its constructor raises
    without it); the same import megatron does (megatron-core 0.16.1 ``tensor_parallel/layers.py``,
    ``_grad_accum_fusion_available``)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:   # ImportError, or OSError from a CUDA library it was built against
        return False
    return True


def te_layer_spec(config):
    """GPT layer spec with Transformer Engine (``get_gpt_layer_with_transformer_engine_spec``).

    Parameter names then follow the TE layout (``self_attention.linear_qkv.layer_norm_weight``
    holds the input RMSNorm; :func:`megatron_rlhf.convert.rules.align_names` maps them).

    Args:
        config: megatron ``TransformerConfig`` (``qk_layernorm`` read from it).
    Returns:
        a ``ModuleSpec`` for ``GPTModel(transformer_layer_spec=...)``.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    return specs.get_gpt_layer_with_transformer_engine_spec(
        qk_layernorm=bool(getattr(config, "qk_layernorm", False)))


def seed(seed_value: int) -> None:
    """Seed torch (CPU and CUDA) and megatron's CUDA RNG tracker
    (``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed``)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed_value)
    model_parallel_cuda_manual_seed(seed_value)


def apply_learner_cuda_env() -> dict[str, str]:
    """Set :data:`LEARNER_CUDA_ENV` in ``os.environ`` where the user has not set the key; called by
    ``Platform.install`` in the learner process before ``torch.cuda.set_device`` creates its CUDA
    context (the variable is read then). Returns what this process now has for each key; logs a
    warning when CUDA was already initialised (the value then applies to no context of this
    process)."""
    out = {}
    for key, value in LEARNER_CUDA_ENV.items():
        out[key] = os.environ.setdefault(key, value)
    if torch.cuda.is_initialized():
        log.warning("CUDA was initialised before %s was set: it has no effect in this process", out)
    return out
