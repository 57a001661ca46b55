"""Where an exporter's staging buffer lives: decided once per run, from the memory plan.

An exporting learner rank keeps one staging copy of its whole stage (the HF tensors of the
version on the wire, so the next train step may change the parameters while it is sent). It lives
on the learner's device when the memory plan leaves room for it there, else in pinned host memory,
and the wire then needs two device chunk buffers (double-buffered host -> device copies). The
decision is a pure function of numbers known before the first publish (the plan's resident bytes
of a learner GPU, ``tools/plan_memory.py``, and the device's total memory), never of
``torch.cuda.mem_get_info()`` (it excludes PyTorch's cached blocks, so it depends on the
allocator's history, and a flip would re-allocate the whole stage).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagingPlan", "plan_staging", "HEADROOM"]

HEADROOM = 0.9
"""Share of the device memory the plan plus a device staging may fill (``tools/plan_memory.py``
asks for 5-10% allocator slack)."""

_GiB = 2**30


@dataclass(frozen=True)
class StagingPlan:
    """Where the staging lives and what it costs.

    Attributes:
        place: ``device`` or ``host``.
        stage_bytes: the staging buffer (the stage's HF tensors, laid out).
        device_bytes: bytes it adds on the learner's device (the whole staging, or two wire
            chunk buffers for host staging on a GPU; 0 on CPU, where device and host are one).
        host_bytes: bytes it takes in host memory (pinned on a GPU).
        reason: why, in words (the one log line).
    """

    place: str
    stage_bytes: int
    device_bytes: int
    host_bytes: int
    reason: str

    def describe(self) -> str:
        """One log line naming the place, the sizes and why."""
        return (f"weight-sync staging: {self.place} ({self.stage_bytes / _GiB:.2f} GiB staged; "
                f"{self.device_bytes / _GiB:.2f} GiB on the learner device, {self.host_bytes / _GiB:.2f} GiB host): "
                f"{self.reason}")


def plan_staging(stage_bytes: int, chunk_bytes: int, *, planned_bytes: float | None,
                 device_total_bytes: float | None, is_cpu: bool, headroom: float = HEADROOM) -> StagingPlan:
    """Decide where a staging buffer of ``stage_bytes`` lives (see the module docstring).

    Rule: CPU -> host (the device is the host). GPU -> device when ``planned_bytes +
    stage_bytes <= headroom * device_total_bytes``, else host staging plus two device chunk
    buffers of ``min(chunk_bytes, stage_bytes)``; without a plan (``planned_bytes`` or
    ``device_total_bytes`` None) host, the choice that cannot run the device out of memory.

    Args:
        stage_bytes: the stage's staging size (``StageLayout.nbytes``), bytes.
        chunk_bytes: the wire's chunk size (``generators.weight_sync_bucket_mb``), bytes.
        planned_bytes: resident bytes of one learner GPU of the plan (weights, grads, optimizer,
            reference, activations, logits, overhead; ``tools/plan_memory.py``).
        device_total_bytes: the device's total memory, bytes.
        is_cpu: the learner runs on CPU.
        headroom: share of the device the plan plus the staging may fill.
    Raises:
        ValueError: ``stage_bytes`` or ``chunk_bytes`` below 1, or ``headroom`` not in (0, 1].
    """
    if stage_bytes < 1 or chunk_bytes < 1:
        raise ValueError(f"plan_staging(stage_bytes={stage_bytes}, chunk_bytes={chunk_bytes}): both must be >= 1 "
                         "(generators.weight_sync_bucket_mb > 0)")
    if not 0 < headroom <= 1:
        raise ValueError(f"plan_staging(headroom={headroom}): must be in (0, 1]")
    stage_bytes, wire = int(stage_bytes), 2 * min(int(chunk_bytes), int(stage_bytes))
    if is_cpu:
        return StagingPlan("host", stage_bytes, 0, stage_bytes, "CPU learner: the device is the host")
    if planned_bytes is None or device_total_bytes is None:
        return StagingPlan("host", stage_bytes, wire, stage_bytes,
                           "no memory plan given: pinned host staging cannot run the device out of memory")
    need, room = float(planned_bytes) + stage_bytes, headroom * float(device_total_bytes)
    if need <= room:
        return StagingPlan("device", stage_bytes, stage_bytes, 0,
                           f"plan {planned_bytes / _GiB:.1f} GiB + staging {stage_bytes / _GiB:.1f} GiB "
                           f"<= {headroom:.0%} of {device_total_bytes / _GiB:.1f} GiB")
    return StagingPlan("host", stage_bytes, wire, stage_bytes,
                       f"plan {planned_bytes / _GiB:.1f} GiB + staging {stage_bytes / _GiB:.1f} GiB "
                       f"> {headroom:.0%} of {device_total_bytes / _GiB:.1f} GiB; two {min(chunk_bytes, stage_bytes) / _GiB:.2f} "
                       "GiB wire buffers on the device")
