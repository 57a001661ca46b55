"""CPU platform: every shim megatron-core 0.16.1 needs to run on a CPU-only torch build (gloo).

Nothing here runs at import (importing the module imports megatron-core, which only warns that
Apex/TE are absent). :func:`install` patches *torch only* (never megatron modules), and
only when CUDA is absent; it is idempotent and :func:`uninstall` restores torch. What it fixes
(verified in ``shared/notes/probes/megatron_cpu/cuda_shim.py``):

* P1 ``torch.cuda.current_device`` -> ``torch.device("cpu")``: megatron passes it as ``device=``
  in ~60 places (RoPE ``inv_freq``, TP all-gather buffers, p2p shape buffers, DDP buffers,
  dist_checkpointing save).
* P2 ``torch.cuda.synchronize`` -> no-op (p2p communication, checkpoint preload).
* P5 ``torch.cuda.get_rng_state`` (also ``torch.cuda.random.get_rng_state``) -> an empty
  ``uint8`` tensor: megatron's activation checkpointing (``tensor_parallel.checkpoint``, used by
  ``learner.recompute`` full and selective) saves the CUDA RNG state before a recomputed region
  and restores it after; there is no CUDA generator on CPU, so the state is an empty placeholder,
  and megatron's restore (``_set_cuda_rng_state``) goes through ``torch.cuda._lazy_call``, which
  queues the callback until CUDA initialises, i.e. never. The CPU generator (dropout) is saved
  and restored by megatron itself (``torch.get_rng_state``).
* P3 :class:`CudaToCpuMode`, a ``TorchFunctionMode`` that rewrites ``device="cuda"`` /
  ``"cuda:N"`` / int device literals and ``Tensor.cuda()`` / ``Tensor.to("cuda")`` to CPU
  (pipeline schedules' ``torch.zeros(..., device="cuda")``, tied embeddings under PP).
* P4 (scoped, never global) :func:`optimizer_context`: megatron's ``FP32Optimizer.__init__``
  and gradient clipping (``clip_grad_by_total_norm_fp32``) allocate ``device='cuda'``, and the
  clipping and the DistributedOptimizer assert ``grad.type() == 'torch.cuda.FloatTensor'``;
  inside this context ``Tensor.type()`` reports CPU tensors as ``torch.cuda.*`` and P3 applies.
  The learner wraps only ``get_megatron_optimizer(...)`` and ``optimizer.step()`` in it.

The model-level CPU pieces go through megatron's public ``ModuleSpec`` mechanism instead of
patching: :class:`SDPACoreAttention` (``DotProductAttention.forward`` allocates a CUDA scratch
buffer) and :class:`CPUNorm` (torch ``RMSNorm``/``LayerNorm``; unlike megatron's
``WrappedTorchNorm`` it also accepts ``sequence_parallel=True``).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.overrides import TorchFunctionMode

__all__ = ["install", "uninstall", "is_installed", "function_mode_active", "optimizer_context",
           "seed", "cpu_layer_spec", "CudaToCpuMode", "CudaTypeSpoofMode", "SDPACoreAttention",
           "CPUNorm"]

_LOCK = threading.Lock()
_STATE: dict = {"installed": False, "mode": None, "orig": None}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # torch: int device = CUDA index


class CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device requests of any torch call to CPU (P3).

    Handles ``device=`` keyword arguments (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``,
    an int index), ``Tensor.cuda()`` (returns the tensor itself) and ``Tensor.to("cuda"...)``.
    Everything else passes through unchanged. Source: ``torch.overrides.TorchFunctionMode``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class CudaTypeSpoofMode(CudaToCpuMode):
    """P3 plus P4: CUDA device requests go to CPU, and ``Tensor.type()`` (no arguments) of a CPU
    tensor returns ``'torch.cuda.<T>Tensor'``. Only for megatron's optimizer construction and step
    (``FP32Optimizer`` and grad clipping allocate ``device='cuda'``, clipping asserts CUDA grads);
    see :func:`optimizer_context`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str) \
                and out.startswith("torch.") and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out


@contextlib.contextmanager
def optimizer_context():
    """Scope of P3+P4: wrap megatron optimizer construction and ``step()`` on CPU (no-op when
    CUDA is available)."""
    if torch.cuda.is_available():
        yield
        return
    with CudaTypeSpoofMode():
        yield


def _no_cuda_rng_state(device="cuda") -> torch.Tensor:
    """P5: the CUDA RNG state of a machine without CUDA (an empty placeholder)."""
    return torch.empty(0, dtype=torch.uint8)


def is_installed() -> bool:
    """True when :func:`install` patched torch in this process."""
    return bool(_STATE["installed"])


def install(function_mode: bool = True) -> bool:
    """Install P1, P2, P5 and, with ``function_mode``, P3 (see module doc) when CUDA is absent.

    Idempotent: repeated calls change nothing; a call with ``function_mode=True`` after one
    without adds P3. P3 costs ~15% of a CPU forward (every torch call goes through Python), and
    TP/PP=1 training does not need it (the optimizer step gets it scoped, see
    :func:`optimizer_context`), so the learner enables it only for pipeline parallelism.
    The mode stack is per thread: install from the thread that runs the model.

    Returns:
        True when the shims are active after the call, False when CUDA is available (then
        nothing is patched: the GPU path must never see them).
    """
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if not _STATE["installed"]:
            _STATE["orig"] = (torch.cuda.current_device, torch.cuda.synchronize,
                              torch.cuda.get_rng_state, torch.cuda.random.get_rng_state)
            torch.cuda.current_device = lambda: torch.device("cpu")
            torch.cuda.synchronize = lambda *a, **k: None
            torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = _no_cuda_rng_state
            _STATE["installed"] = True
        if function_mode and _STATE["mode"] is None:
            mode = CudaToCpuMode()
            mode.__enter__()  # stays on this thread's torch-function mode stack until uninstall()
            _STATE["mode"] = mode
    return True


def function_mode_active() -> bool:
    """True when the global P3 mode is installed."""
    return _STATE["mode"] is not None


def uninstall() -> None:
    """Undo :func:`install`: restore torch's functions and leave the P3 mode. No-op if not installed.

    Only for tests and for processes that hand the interpreter to GPU code afterwards; call it
    from the thread that called :func:`install`.
    """
    with _LOCK:
        if _STATE["mode"] is not None:
            _STATE["mode"].__exit__(None, None, None)
        if _STATE["installed"]:
            (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
             torch.cuda.random.get_rng_state) = _STATE["orig"]
        _STATE.update(installed=False, mode=None, orig=None)


def seed(seed_value: int) -> None:
    """Seed torch's CPU generator and megatron's RNG tracker without touching CUDA.

    ``model_parallel_cuda_manual_seed`` needs CUDA; the inference tracker's ``fork()`` is a
    ``nullcontext``, so dropout inside megatron's TP regions draws from the CPU generator.
    Source: ``megatron.core.tensor_parallel.random.initialize_rng_tracker``.
    """
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed_value)


class SDPACoreAttention(DotProductAttention):
    """Megatron core attention computed with ``torch.nn.functional.scaled_dot_product_attention``.

    Inputs ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (GQA: ``ng`` query groups;
    query head ``h`` uses group ``h // (np // ng)``, as megatron lays out QKV), ``attention_mask``
    (megatron convention: True = masked out) or None for the spec's causal mask.
    Returns ``[sq, b, np * hn]``. Dropout uses ``config.attention_dropout`` in training mode.
    Same constructor as ``megatron.core.transformer.dot_product_attention.DotProductAttention``.

    Raises:
        NotImplementedError: packed sequences, attention bias, query-key layer scaling or
            sliding-window attention (not needed by Llama-family models).
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences / attention bias")
        if self.config.apply_query_key_layer_scaling or self.config.window_size is not None:
            raise NotImplementedError("SDPACoreAttention: set apply_query_key_layer_scaling=False "
                                      "and window_size=None")
        sq, b, np_, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.config.attention_dropout if self.training else 0.0
        gqa = key.size(2) != np_
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 dropout_p=dropout, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout,
                                                 is_causal=mask_type == AttnMaskType.causal,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


class CPUNorm:
    """Norm factory for megatron ModuleSpecs: torch ``RMSNorm`` or ``LayerNorm`` per
    ``config.normalization``; parameters are tagged ``sequence_parallel`` so megatron's
    ``finalize_model_grads`` all-reduces their grads under sequence parallelism.

    Args (as megatron passes them): ``config`` (TransformerConfig), ``hidden_size``, ``eps``.
    Returns a ``torch.nn.RMSNorm``/``LayerNorm`` over the last dimension ``[..., hidden_size]``.
    Raises ValueError for other ``normalization`` values.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"CPUNorm: normalization={config.normalization!r}; "
                             "expected RMSNorm or LayerNorm")
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def cpu_layer_spec(config):
    """GPT block spec for CPU: megatron's local layer spec with SDPA core attention and
    :class:`CPUNorm` for the input, pre-MLP and final norms.

    Parameter names are those of the local spec (``decoder.layers.N.input_layernorm.weight``,
    ``...self_attention.linear_qkv.weight``, ``...mlp.linear_fc1.weight``, ...,
    ``decoder.final_layernorm.weight``); checkpoints use the TE layout names through the spec's
    ``sharded_state_dict_keys_map`` (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``).

    Args:
        config: megatron ``TransformerConfig`` (its PP size decides how many layers this rank builds).
    Returns:
        ``ModuleSpec(TransformerBlock)`` to pass as ``GPTModel(transformer_layer_spec=...)``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layer = get_gpt_layer_local_spec(normalization=config.normalization,
                                     qk_layernorm=bool(getattr(config, "qk_layernorm", False)))
    attn = layer.submodules.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    if attn.q_layernorm is not None and getattr(config, "qk_layernorm", False):
        attn.q_layernorm = CPUNorm
        attn.k_layernorm = CPUNorm
    layer.submodules.input_layernorm = CPUNorm
    layer.submodules.pre_mlp_layernorm = CPUNorm
    n = get_num_layers_to_build(config)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * n,
                                                            layer_norm=CPUNorm))
