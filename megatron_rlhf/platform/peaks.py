"""Dense peak TFLOP/s of accelerators, for MFU (``perf/mfu``, ``bench/learner.py``).

Vendor datasheet values per device, dense (no 2:4 sparsity), tensor cores; only dtypes whose
peak is listed. Matching is by substring of ``torch.cuda.get_device_name()`` (e.g.
``"NVIDIA H100 80GB HBM3"``), most specific first. CPUs have no entry: their peak depends on
cores, clock and vector units, so no MFU is reported on CPU (``bench/learner.py`` estimates one
from /proc/cpuinfo for its own use). ``learner.peak_tflops`` overrides the table.

Sources: NVIDIA H100 datasheet (SXM5 bf16/fp16 989.4, PCIe 756; tf32 494.7 / 378), H200
datasheet (SXM 989.4; NVL 835.6; GH200 as H100 SXM), A100 datasheet (bf16/fp16 312, tf32 156),
B200 (HGX B200: bf16 2250 dense), GB200 (GB200 NVL72 datasheet: FP16/BF16 5 PFLOPS per GPU with
sparsity, so 2500 dense; TF32 1250 dense), H100 NVL (datasheet: bf16 1671 with sparsity, so 835.6
dense), L40S (bf16 362 dense). Order matters: "H100 NVL" before "H100", "GB200" before "B200"
(``"NVIDIA GB200"`` contains ``B200``; review N12).
"""

from __future__ import annotations

__all__ = ["PEAK_TFLOPS", "device_peak_tflops", "peak_tflops"]

PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    ("H200 NVL", {"bfloat16": 835.6, "float16": 835.6}),
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    ("H100 NVL", {"bfloat16": 835.6, "float16": 835.6}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    ("GB200", {"bfloat16": 2500.0, "float16": 2500.0, "float32": 1250.0}),
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0}),
)
"""``(device-name substring, {dtype: dense TFLOP/s})``, most specific first. float32 is the TF32
tensor-core peak (the rate of fp32 matmuls with TF32 allowed)."""

_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of one device named ``device_name`` computing in ``dtype``.

    Args:
        device_name: e.g. ``torch.cuda.get_device_name()``, or ``"cpu"``.
        dtype: ``bfloat16`` / ``float16`` / ``float32`` (or ``bf16``, ``fp16``, ``fp32``, a
            ``torch.dtype``).
    Returns:
        TFLOP/s, or None when the device or the dtype is not in :data:`PEAK_TFLOPS` (every CPU).
    """
    dt = str(dtype).replace("torch.", "")
    dt = _ALIASES.get(dt, dt)
    name = device_name or ""
    for key, table in PEAK_TFLOPS:
        if key in name:
            return table.get(dt)
    return None


def device_peak_tflops(device: str, dtype, override: float | None = None) -> float | None:
    """Peak TFLOP/s of this process's device: ``override`` (``learner.peak_tflops``) when given,
    else on ``device == "cuda"`` :func:`peak_tflops` of ``torch.cuda.get_device_name()``; on CPU
    None (no MFU on CPU, see the module doc)."""
    if override:
        return float(override)
    if device != "cuda":
        return None
    import torch

    return peak_tflops(torch.cuda.get_device_name(), dtype)
