"""Fault injection for the crash-and-resume tests: ``kill -9`` of the driver at a named point.

``MRLHF_TEST_KILL_AT="<point>:<step>"`` makes :func:`kill_point` SIGKILL the calling process when it
reaches ``point`` for ``step`` (1-based learner step). Points, in the order a step meets them:

* ``generation``: the producer has generated the first round of the batch that step ``step`` will
  train (mid-generation);
* ``row``: the loop has written step ``step``'s metrics row, before its checkpoint;
* ``save``: the checkpoint of step ``step`` is half written (the learner's files are there, the
  ``COMPLETE`` marker is not).

Unset in real runs (then every call is a dictionary lookup). A new point is one call in the code
and one name here.
"""

from __future__ import annotations

import os
import signal

__all__ = ["kill_point", "POINTS"]

POINTS = ("generation", "row", "save")
ENV = "MRLHF_TEST_KILL_AT"


def kill_point(point: str, step: int) -> None:
    """SIGKILL this process if ``MRLHF_TEST_KILL_AT`` names ``point`` and ``step``.

    Raises:
        ValueError: the variable names an unknown point (a typo in a test).
    """
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, at = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown point {name!r}; one of {POINTS}")
    if name == point and int(at) == step:
        print(f"[megatron-rlhf] test fault: kill -9 at {point} of step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
