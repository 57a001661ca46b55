"""Debug modes (slime's ``--debug-rollout-only`` / ``--debug-train-only``; config ``run.mode``).

* ``rollout_only``: the generator side runs as usual (base weights, no training, no weight push)
  and every batch is saved to ``<run>/rollouts/`` in the one on-disk batch format
  (``rollout.batch_io``); ``run.save_rollouts: true`` saves them in a training run too.
* ``train_only`` with ``run.replay: DIR``: :class:`ReplayProducer` stands in for the rollout
  producer and hands the learner the saved batches of ``DIR`` in index order; no vLLM engine is
  started, no weights are pushed, no eval runs. The learner trains exactly as on live batches, so
  a replay of a live run's saved batches gives that run's losses (``tests/test_replay.py``).

Consumes: batch files. Waits for: space in the queue (maxsize 1). Unblocked by: the learner
taking a batch.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from megatron_rlhf.rollout.producer import put_until_stopped
from megatron_rlhf.rollout.batch_io import batch_path, list_batches, load_batch

__all__ = ["ReplayProducer", "ROLLOUTS_DIR", "check_replay_dir"]

ROLLOUTS_DIR = "rollouts"
"""Sub-folder of the run folder where saved batches go."""


def check_replay_dir(folder: str | Path, first_batch: int, num_batches: int, *, algorithm: dict | None = None,
                     prompts_per_step: int | None = None, vocab_size: int | None = None) -> Path:
    """The replay folder (a run folder's ``rollouts/`` is found from the run folder too), checked
    before any actor starts: it holds batch files ``first_batch .. num_batches-1``, each readable,
    holding its own index, built for this config's ``algorithm`` (the file's tag,
    :func:`~megatron_rlhf.rollout.batch_io.algorithm_tag`), with ``prompts_per_step`` groups and
    token ids below the model's ``vocab_size`` (a folder saved by another run with another loss,
    K, batch size or tokenizer would otherwise fail mid-run, or train on the wrong kind of batch).

    Raises:
        ValueError: any of these fails; names ``run.replay``, the file and the fix.
    """
    from megatron_rlhf.rollout.batch_io import load_batch

    folder = Path(folder).expanduser().resolve()
    if (folder / ROLLOUTS_DIR).is_dir() and not list_batches(folder):
        folder = folder / ROLLOUTS_DIR
    if not folder.is_dir():
        raise ValueError(f"run.replay = {str(folder)!r} is not a folder; give a folder of saved batches "
                         "(a rollout_only run's rollouts/)")
    missing = [k for k in range(first_batch, num_batches) if not batch_path(folder, k).is_file()]
    if missing:
        have = len(list_batches(folder))
        raise ValueError(f"run.replay = {str(folder)!r} lacks batches {missing[:5]}{'...' if len(missing) > 5 else ''} "
                         f"({have} saved); lower run.num_steps to {have} or save more (run.mode=rollout_only)")
    for k in range(first_batch, num_batches):
        path = batch_path(folder, k)
        try:
            batch, tag = load_batch(path, with_algorithm=True)
        except ValueError as e:
            raise ValueError(f"run.replay: {e}; save the batch again or replay fewer steps (run.num_steps)") from e
        if batch.index != k:
            raise ValueError(f"run.replay: {path} holds batch {batch.index}, not {k}; the folder's files were "
                             "renamed or mixed from two runs")
        if algorithm is not None and tag is not None and dict(tag) != dict(algorithm):
            want = ", ".join(f"{f}={tag.get(f)!r}" for f in ("loss", "samples_per_prompt", "unit"))
            have = ", ".join(f"{f}={algorithm.get(f)!r}" for f in ("loss", "samples_per_prompt", "unit"))
            raise ValueError(f"run.replay: {path} was built for algorithm {want}; this config trains {have}: "
                             "set algorithm.loss / algorithm.samples_per_prompt as the saving run had them, "
                             "or replay batches saved with this algorithm")
        if prompts_per_step is not None and len(batch.groups) != prompts_per_step:
            raise ValueError(f"run.replay: {path} holds {len(batch.groups)} prompt groups; this config trains "
                             f"algorithm.prompts_per_step={prompts_per_step}: set it to {len(batch.groups)}")
        if vocab_size is not None:
            top = max((t for g in batch.groups for r in g.rollouts
                       for t in (*g.prompt.token_ids, *r.completion.token_ids)), default=-1)
            if top >= vocab_size:
                raise ValueError(f"run.replay: {path} holds token id {top}, beyond this model's vocabulary "
                                 f"({vocab_size} ids): the batches were saved with another tokenizer; replay "
                                 "them with the model that generated them (model.*)")
    return folder


class ReplayProducer:
    """Puts the saved batches ``first_batch .. num_batches-1`` of ``folder`` on ``out_queue``
    (same interface as ``RolloutProducer``: :meth:`run` as a thread body, ``stop_event``); a
    load error is put on the queue and ends the thread, as a generation error would."""

    def __init__(self, folder: Path, out_queue: queue.Queue, first_batch: int, num_batches: int):
        self.folder, self.out_queue = Path(folder), out_queue
        self.first_batch, self.num_batches = first_batch, num_batches
        self.stop_event = threading.Event()
        self.phase = "replaying saved batches"   # the hang watchdog's view

    def run(self) -> None:
        try:
            for k in range(self.first_batch, self.num_batches):
                batch = load_batch(batch_path(self.folder, k))
                if batch.index != k:
                    raise ValueError(f"{batch_path(self.folder, k)} holds batch {batch.index}, not {k}")
                if not put_until_stopped(self.out_queue, batch, self.stop_event):
                    return
        except BaseException as e:  # noqa: BLE001 - forwarded to the learner loop
            self.out_queue.put(e)
