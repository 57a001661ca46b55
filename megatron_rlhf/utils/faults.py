"""Fault injection, a product hook that is off unless an environment variable names a point: ``kill
-9`` of the driver at a named point, the death of a generator engine in a named phase of the
generator pool, and a slow checkpoint writer. The crash-and-resume tests set
the variables (``tests/test_exact_resume.py``, ``tests/test_reliability_loop.py``); the product code
calls the points, so what a test kills is the code a user runs.

``MRLHF_TEST_KILL_AT="<point>:<step>"`` makes :func:`kill_point` SIGKILL the calling process when it
reaches ``point`` for ``step`` (1-based learner step). Points, in the order a step meets them:

* ``generation``: the producer has generated the first round of the batch that step ``step`` will
  train (mid-generation);
* ``row``: the loop has written step ``step``'s metrics row, before its checkpoint;
* ``save``: the checkpoint of step ``step`` is half written (the learner's files are there, the
  ``COMPLETE`` marker is not);
* ``async_save``: with ``checkpoint.async_save``, the learner has started writing the checkpoint of
  step ``step`` in the background (the loop would train on now; nothing of it is complete).

``MRLHF_TEST_KILL_ENGINE_AT="<phase>:<batch>:<engine>"`` makes :func:`engine_kill_point` kill
generator engine ``engine`` (its index in the pool) the first time the pool reaches ``phase`` in
batch ``batch`` (0-based; the pool's ``batch_index``), with ``ray.kill(no_restart=False)``: the
process dies as under ``kill -9`` and Ray restarts it (``generators.max_restarts``). Phases
(:data:`ENGINE_POINTS`, ``generator.pool``): ``reseed`` (before the engines are reseeded between
batches), ``generate`` (a request was just sent to it), ``push`` (a weight load was just started:
publishing), ``check`` (before the weight-sync probe), ``abort`` (the batch is full and its
running requests were just aborted). Each spec fires once per process, so the restarted engine
is not killed again when the pool repeats the call.

``MRLHF_TEST_SLOW_WRITER_S=<seconds>`` makes every asynchronous checkpoint writer of the learner
sleep that long in its forked process before it writes (:func:`slow_writer_s`), so that a test sees
training go on while a checkpoint is being written. The learner actors get every ``MRLHF_TEST_*``
variable of the driver (:func:`actor_env`, ``trainer.setup.build_actors``).

Unset in real runs (then every call is a dictionary lookup and changes nothing). A new point is one
call in the code and one name in :data:`POINTS`.
"""

from __future__ import annotations

import os
import signal

__all__ = ["kill_point", "POINTS", "engine_kill_point", "ENGINE_POINTS", "slow_writer_s", "actor_env"]

POINTS = ("generation", "row", "save", "async_save")
ENV = "MRLHF_TEST_KILL_AT"
ENGINE_POINTS = ("reseed", "generate", "push", "check", "abort")
ENGINE_ENV = "MRLHF_TEST_KILL_ENGINE_AT"
_engine_fired: set[str] = set()
SLOW_WRITER_ENV = "MRLHF_TEST_SLOW_WRITER_S"


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


def engine_kill_point(phase: str, batch: int, engine: int, handle) -> None:
    """Kill generator engine ``handle`` (index ``engine``) if ``MRLHF_TEST_KILL_ENGINE_AT`` names
    ``phase``, ``batch`` and ``engine`` and has not fired in this process yet (module doc).

    Raises:
        ValueError: the variable is malformed or names an unknown phase (a typo in a test).
    """
    spec = os.environ.get(ENGINE_ENV)
    if not spec or spec in _engine_fired:
        return
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in ENGINE_POINTS or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"{ENGINE_ENV}={spec!r}: want '<phase>:<batch>:<engine>', phase one of {ENGINE_POINTS}")
    if (parts[0], int(parts[1]), int(parts[2])) == (phase, batch, engine):
        import ray

        _engine_fired.add(spec)
        print(f"[megatron-rlhf] test fault: generator engine {engine} killed at {phase} of batch {batch}",
              flush=True)
        ray.kill(handle, no_restart=False)


def slow_writer_s() -> float:
    """Seconds an asynchronous checkpoint writer sleeps before writing (``MRLHF_TEST_SLOW_WRITER_S``;
    0 when unset, as in real runs).

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    spec = os.environ.get(SLOW_WRITER_ENV) or "0"
    try:
        delay = float(spec)
    except ValueError:
        delay = -1.0
    if not delay >= 0:
        raise ValueError(f"{SLOW_WRITER_ENV}={spec!r}: not a number of seconds >= 0")
    return delay


def actor_env() -> dict[str, str]:
    """The driver's ``MRLHF_TEST_*`` variables, for the ``runtime_env`` of the actors that read them
    (empty in real runs: the actors' options are then unchanged)."""
    return {k: v for k, v in os.environ.items() if k.startswith("MRLHF_TEST_")}
