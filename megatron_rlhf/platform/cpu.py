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

The model-level pieces go through megatron's public ``ModuleSpec`` mechanism instead of
patching, and are device-agnostic (the GPU learner without Transformer Engine builds the same
spec): :mod:`megatron_rlhf.platform.local_spec` (``SDPACoreAttention``: megatron's
``DotProductAttention.forward`` allocates a CUDA scratch buffer; ``TorchNorm``, re-exported here as
``CPUNorm``: unlike megatron's ``WrappedTorchNorm`` it accepts ``sequence_parallel=True``).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from megatron_rlhf.platform.local_spec import SDPACoreAttention, TorchNorm
from megatron_rlhf.platform.local_spec import local_layer_spec as cpu_layer_spec

CPUNorm = TorchNorm   # the name the CPU tests and older code use

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
