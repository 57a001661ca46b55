"""A learner group: TP x PP x DP :class:`~megatron_rlhf.learner.actor.MegatronLearner` ranks as Ray
actors, driven by one coordinator with the same verbs as a single ``MegatronLearner``.

    group_cls = ray.remote(num_cpus=0)(LearnerGroup)          # the trainer's way: an actor
    learner = group_cls.remote(model_dir=..., learner_cfg=cfg.learner, algorithm_cfg=...,
                               rank_actor_options={"num_cpus": 1, "num_gpus": 1})
    metrics = ray.get(learner.train_step.remote(batch))
    buckets = ray.get(learner.export_weights.remote())         # list of ObjectRefs of buckets

    group = LearnerGroup(...)                                  # or a plain object in the driver

Why a coordinator (and not N actor handles in the trainer): the trainer's loop stays the same for
1 or 1024 learner ranks (``learner.train_step.remote(batch)``); the coordinator fans each call
out to every rank (every verb is collective inside torch.distributed), waits for all of them (so
a failing rank surfaces as an error, not a hang in the caller), and returns the result of the
rank that owns it:

* metrics and logprobs: the *reporting rank* (last pipeline stage, TP rank 0, DP rank 0), which
  already holds values over the whole batch (DP ranks exchange them inside ``train_step``);
* ``export_weights``: each pipeline stage's TP-rank-0 / DP-rank-0 rank gathers its stage tensor by
  tensor over TP and ``ray.put`` s each bucket as soon as it is full; the coordinator returns the
  concatenated list of bucket ObjectRefs in stage order (= HF checkpoint order). The buckets go
  from the ranks' object stores straight to the generator (``update_weights`` resolves them):
  no process ever holds a second full copy of the model, the coordinator holds only references;
* ``save_checkpoint`` / ``load_checkpoint`` / ``export_hf``: every rank reads/writes its own
  shards (see :class:`MegatronLearner`); the coordinator only waits.

The coordinator needs no CPU or GPU of its own (``num_cpus=0``). The ranks it creates are owned by
it, so killing the coordinator (``ray.kill``) also ends them (Ray fate-sharing of owned actors).
Rendezvous: rank 0 picks its node address and a free port; all ranks then call
``torch.distributed.init_process_group(init_method="tcp://ADDR:PORT")`` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["LearnerGroup"]


class _LearnerRank:
    """One rank: an empty actor until :meth:`build` (so rank 0 can report its address first)."""

    def __init__(self):
        self.learner = None

    @staticmethod
    def rendezvous_address() -> str:
        """``HOST:PORT``: this node's Ray address and a free TCP port (bound, then released)."""
        import socket

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def build(self, **kwargs) -> dict:
        from megatron_rlhf.learner.actor import MegatronLearner

        self.learner = MegatronLearner(**kwargs)
        return self.learner.layout()

    def apply(self, fn, *args):
        """``fn(self.learner, *args)`` (a module-level function, e.g. of the weight transport)."""
        if self.learner is None:
            raise RuntimeError(f"learner rank not built; cannot run {getattr(fn, '__name__', fn)}")
        return fn(self.learner, *args)

    def call(self, method: str, *args, **kwargs):
        if self.learner is None:
            raise RuntimeError(f"learner rank not built; cannot call {method}")
        return getattr(self.learner, method)(*args, **kwargs)


class LearnerGroup:
    """TP x PP x DP learner ranks behind the verbs of :class:`MegatronLearner`.

    Args:
        model_dir, learner_cfg, algorithm_cfg, dtype, seed, total_steps, temperature: as for
            :class:`MegatronLearner` (the layout comes from ``learner_cfg.tensor_parallel``,
            ``pipeline_parallel``, ``data_parallel``).
        cpu_core: rank r is pinned to core ``cpu_core + r`` (modulo the cores of its node);
            -1: no pinning.
        rank_actor_options: ``ray.remote`` options of each rank actor (default one CPU; on GPU
            clusters ``num_gpus=1`` and the learner role resource, see ``trainer.setup.actor_options``),
            or a list of them, one per rank (placement-group bundles:
            ``megatron_rlhf.placement.ActorPlacement.learner_options``).
        timeout_s: upper bound of any wait on the ranks (seconds).
    Raises:
        ValueError: bad layout (raised by every rank's ``MegatronLearner``).
        ray.exceptions.GetTimeoutError: ranks did not answer within ``timeout_s``.
    """

    def __init__(self, *, model_dir: str, learner_cfg, algorithm_cfg, dtype: str = "float32",
                 seed: int = 0, total_steps: int = 1, cpu_core: int = -1,
                 rank_actor_options: dict | None = None, timeout_s: float = 1800.0,
                 temperature: float = 1.0):
        import ray

        t0 = time.perf_counter()
        self.timeout_s = float(timeout_s)
        c = learner_cfg
        self.world_size = c.tensor_parallel * c.pipeline_parallel * c.data_parallel
        per_rank = (list(rank_actor_options) if isinstance(rank_actor_options, (list, tuple))
                    else [rank_actor_options] * self.world_size)
        self._ranks = [ray.remote(**{"num_cpus": 1, "max_restarts": 0, **(o or {})})(_LearnerRank).remote()
                       for o in per_rank]
        self._closed = False
        try:
            address = self._get(self._ranks[0].rendezvous_address.remote())
            self.layouts = self._get([a.build.remote(
                model_dir=str(model_dir), learner_cfg=learner_cfg, algorithm_cfg=algorithm_cfg,
                dtype=dtype, seed=seed, total_steps=total_steps, temperature=temperature,
                cpu_core=cpu_core + r if cpu_core >= 0 else -1, rank=r, world_size=self.world_size,
                init_method=f"tcp://{address}") for r, a in enumerate(self._ranks)])
        except BaseException:
            self._kill()
            raise
        self._report = next(r for r, lay in enumerate(self.layouts)
                            if lay["is_last_stage"] and lay["tp_rank"] == 0 and lay["dp_rank"] == 0)
        self._exporters = sorted((r for r, lay in enumerate(self.layouts)
                                  if lay["tp_rank"] == 0 and lay["dp_rank"] == 0),
                                 key=lambda r: self.layouts[r]["pp_rank"])
        self.build_s = time.perf_counter() - t0

    # ----------------------------------------------------------------------------- plumbing
    def _get(self, refs):
        import ray

        return ray.get(refs, timeout=self.timeout_s)

    def _all(self, method: str, *args, **kwargs) -> list:
        """Call ``method`` on every rank at once; results in rank order."""
        if self._closed:
            raise RuntimeError("LearnerGroup is closed")
        return self._get([a.call.remote(method, *args, **kwargs) for a in self._ranks])

    def _all_with_shared_arg(self, method: str, arg, *args, **kwargs) -> list:
        """Like :meth:`_all`, with ``arg`` put into the object store once for all ranks."""
        import ray

        ref = ray.put(arg)
        return self._all(method, ref, *args, **kwargs)

    def call_on_ranks(self, fn, *args) -> list:
        """``fn(rank_learner, *args)`` on every rank at once, each in its rank's own actor thread
        (``fn``: a module-level function, e.g. the weight transport's staging); results in rank
        order. Collective functions see every rank take part."""
        if self._closed:
            raise RuntimeError("LearnerGroup is closed")
        return self._get([a.apply.remote(fn, *args) for a in self._ranks])

    def layout(self) -> list[dict]:
        """Every rank's :meth:`MegatronLearner.layout`, in rank order."""
        return list(self.layouts)

    # ----------------------------------------------------------------------------- verbs
    def train_step(self, batch) -> dict[str, float]:
        """:meth:`MegatronLearner.train_step` on every rank; the reporting rank's metrics
        (over the whole batch) plus ``time/group_train_s`` (wall time including the fan-out)."""
        t0 = time.perf_counter()
        outs = self._all_with_shared_arg("train_step", batch)
        skipped = [o.get("train/skipped_nonfinite") for o in outs]
        if len(set(skipped)) > 1:   # the flag is all-reduced: ranks can only agree
            raise RuntimeError(f"learner ranks disagree on skipping a non-finite update: {skipped}")
        out = dict(outs[self._report])
        out["time/group_train_s"] = time.perf_counter() - t0
        return out

    def token_logprobs(self, input_ids, which: str = "policy", temperature: float = 1.0):
        """``[B, S]`` float32 token logprobs (see :meth:`MegatronLearner.token_logprobs`)."""
        return self._all_with_shared_arg("token_logprobs", input_ids, which, temperature)[self._report]

    def sequence_logprobs(self, input_ids, loss_mask, which: str = "policy", temperature: float = 1.0):
        """``[B]`` float32 masked sums (see :meth:`MegatronLearner.sequence_logprobs`)."""
        import ray

        ids, mask = ray.put(input_ids), ray.put(loss_mask)
        return self._all("sequence_logprobs", ids, mask, which, temperature)[self._report]

    def reference_logprobs(self, input_ids, loss_mask, temperature: float = 1.0):
        """``{"logprobs": [B, S], "reference_version"}`` (see :meth:`MegatronLearner.reference_logprobs`)."""
        import ray

        ids, mask = ray.put(input_ids), ray.put(loss_mask)
        return self._all("reference_logprobs", ids, mask, temperature)[self._report]

    def export_weights(self, bucket_bytes: int = 256 * 2**20) -> list[Any]:
        """HF-named buckets of the policy as a list of ``ray.ObjectRef`` (each of a
        ``dict[str, Tensor]`` of at most ``bucket_bytes``), in HF checkpoint order; accepted as is
        by ``VLLMGenerator.update_weights``."""
        refs = self._all("export_weight_refs", bucket_bytes)
        return [ref for r in self._exporters for ref in refs[r]]

    def gradients_hf(self) -> dict:
        """HF-named full gradients of the last train step (all stages merged; diagnostics)."""
        grads = self._all("gradients_hf")
        return {k: v for r in self._exporters for k, v in grads[r].items()}

    def sync_reference(self) -> None:
        """Copy policy -> reference on every rank."""
        self._all("sync_reference")

    def save_checkpoint(self, path: str, reference_root: str | None = None, async_save: bool = False) -> None:
        """Every rank saves its shards and state under ``path`` (see :meth:`MegatronLearner.save_checkpoint`)."""
        self._all("save_checkpoint", str(path), reference_root, async_save)

    def finalize_checkpoint(self, blocking: bool = True) -> dict | None:
        """Every rank checks / completes the asynchronous save in flight (see
        :meth:`MegatronLearner.finalize_checkpoint`); ``write_s`` and the times span all ranks."""
        outs = [o for o in self._all("finalize_checkpoint", blocking) if o is not None]
        if not outs:
            return None
        if not all(o["done"] for o in outs):
            return {"done": False, "path": outs[0]["path"]}
        start, end = min(o["write_start"] for o in outs), max(o["write_end"] for o in outs)
        return {"done": True, "path": outs[0]["path"], "write_start": start, "write_end": end,
                "write_s": end - start}

    def load_checkpoint(self, path: str) -> int:
        """Every rank loads its shards and state; returns the weight version.

        Raises:
            RuntimeError: ranks restored different versions (a mixed checkpoint folder).
        """
        versions = set(self._all("load_checkpoint", str(path)))
        if len(versions) != 1:
            raise RuntimeError(f"load_checkpoint({path}): ranks restored different versions {versions}")
        return versions.pop()

    def export_hf(self, out_dir: str, base_model_dir: str) -> None:
        """HF folder of the policy, written stage by stage (see :meth:`MegatronLearner.export_hf`)."""
        self._all("export_hf", str(out_dir), str(base_model_dir))

    def get_weight_version(self) -> int:
        """Batches trained (rank 0's count; all ranks agree)."""
        return self._get(self._ranks[0].call.remote("get_weight_version"))

    @property
    def weight_version(self) -> int:
        return self.get_weight_version()

    def close(self) -> None:
        """Close every rank (releases torch.distributed), then end the rank actors. Idempotent."""
        if self._closed:
            return
        try:
            self._all("close")
        finally:
            self._kill()

    def _kill(self) -> None:
        import ray

        self._closed = True
        for a in self._ranks:
            try:
                ray.kill(a)
            except Exception:
                pass
