"""Learner checkpoints and HF export.

Layout of a learner checkpoint folder::

    path/policy/        megatron dist_checkpointing (torch_dist): the policy GPTModel's
                        sharded_state_dict (TE-layout names; reshardable to any TP/PP)
    path/reference/     same for the frozen reference
    path/critic/        same for the PPO critic (only when ``learner.critic`` is not None;
                        :mod:`megatron_rlhf.learner.critic`)
    path/learner_state.pt   torch.save (rank 0): optimizer state dict, LR-scheduler state, RNG
                        states, weight_version, layout (tp, pp, dp, model_type, dtype), and
                        under ``critic`` the critic's optimizer / LR-scheduler state (if any)
    path/learner_state.rank<r>.pt   the same for rank r > 0 of a multi-process learner (its
                        optimizer shard). Not supported with the distributed optimizer yet
                        (raises NotImplementedError).

Every rank of a learner group calls save/load together: ``dist_checkpointing`` is collective
(each rank writes/reads its own shards).

dist_checkpointing's torch_dist writer forks writer processes and creates a ``spawn``
multiprocessing Manager queue once per process (``filesystem_async._get_write_results_queue``);
the spawned manager re-imports ``__main__``, which is safe from pytest, a Ray worker or any script
whose main module has an ``if __name__ == "__main__":`` guard. It needs ``psutil`` (else it hangs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = ["save_learner_checkpoint", "load_learner_checkpoint", "write_hf_folder",
           "STATE_FILE", "state_file"]

STATE_FILE = "learner_state.pt"
_WEIGHT_PATTERNS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json",
                    ".pt", ".pth", ".gguf")


def state_file(path: Path, rank: int) -> Path:
    """The per-rank state file of a learner checkpoint (``learner_state.pt`` for rank 0)."""
    return path / (STATE_FILE if rank == 0 else f"learner_state.rank{rank:05d}.pt")


def _rank(learner) -> int:
    groups = getattr(learner, "groups", None)
    return int(getattr(groups, "rank", 0))


def _refuse_distributed_optimizer(learner) -> None:
    """The DistributedOptimizer's state_dict() omits its DP-sharded Adam state, and restoring it
    through megatron's ``get/load_parameter_state_dp_reshardable`` did not reproduce the next
    update in a DP=2 CPU check (2026-11-30); refuse rather than resume with wrong moments."""
    if getattr(learner, "use_distributed_optimizer", False):
        raise NotImplementedError(
            "learner checkpoints with learner.distributed_optimizer=true are not supported yet "
            "(the sharded Adam state is not restored exactly); set learner.distributed_optimizer="
            "false to checkpoint")


def _save_model(model, folder: Path) -> None:
    from megatron.core import dist_checkpointing

    folder.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(folder))


def _load_model(model, folder: Path) -> None:
    from megatron.core import dist_checkpointing

    if not (folder / "metadata.json").is_file():
        raise FileNotFoundError(f"{folder}: not a megatron dist checkpoint (no metadata.json)")
    state = dist_checkpointing.load(model.sharded_state_dict(), str(folder))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{folder}: checkpoint does not match the model: missing {missing[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}")


def _critic(learner):
    """The learner's PPO critic, or None (attribute ``critic``; absent on older learners)."""
    return getattr(learner, "critic", None)


def save_learner_checkpoint(learner, path: Path) -> None:
    """Write ``learner``'s models (and critic, if any), optimizer, scheduler, RNG and version
    under ``path`` (see module doc). ``path`` may exist; it should be empty (the caller makes the
    save atomic)."""
    _refuse_distributed_optimizer(learner)
    critic = _critic(learner)
    path.mkdir(parents=True, exist_ok=True)
    _save_model(learner.policy, path / "policy")
    _save_model(learner.reference, path / "reference")
    if critic is not None:
        _save_model(critic.model, path / "critic")
    state = {"weight_version": learner.weight_version,
             "optimizer": learner.optimizer.state_dict(),
             "scheduler": learner.scheduler.state_dict(),
             "rng": learner._rng_state(),
             "layout": {"tp": learner.groups.tp, "pp": learner.groups.pp, "dp": learner.groups.dp,
                        "model_type": learner.hf_config.model_type, "dtype": str(learner.dtype),
                        # base HF folder (config, tokenizer) for tools/convert/megatron_to_hf.py
                        "model_dir": os.path.abspath(learner.model_dir)}}
    if critic is not None:
        state["critic"] = critic.state_for_checkpoint()
    torch.save(state, state_file(path, _rank(learner)))
    if learner.groups.world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank's files exist before any rank returns


def load_learner_checkpoint(learner, path: Path) -> int:
    """Restore what :func:`save_learner_checkpoint` wrote into ``learner``; returns the weight
    version.

    Raises:
        FileNotFoundError: ``path/learner_state.pt`` or a model folder is missing.
        ValueError: the checkpoint's layout (TP/PP/DP, model type) differs from the learner's
            (resharding the optimizer is not supported yet; models reshard via dist_checkpointing),
            or the learner has a critic (algorithm.loss=ppo) and the checkpoint has none.
    """
    _refuse_distributed_optimizer(learner)
    sfile = state_file(path, _rank(learner))
    if not sfile.is_file():
        raise FileNotFoundError(f"{path}: no {sfile.name}; not a learner checkpoint (or one "
                                "written by a learner with fewer ranks)")
    state = torch.load(sfile, map_location="cpu", weights_only=False)
    layout = state["layout"]
    mine = {"tp": learner.groups.tp, "pp": learner.groups.pp, "dp": learner.groups.dp,
            "model_type": learner.hf_config.model_type}
    if any(layout.get(k) != v for k, v in mine.items()):
        raise ValueError(f"{path}: checkpoint layout {layout} does not match the learner {mine}")
    critic = _critic(learner)
    if critic is not None and ("critic" not in state or not (path / "critic" / "metadata.json").is_file()):
        raise ValueError(f"{path}: checkpoint has no PPO critic (saved by a learner without one, "
                         "e.g. algorithm.loss != ppo) but this learner has a critic; resume a ppo "
                         "run from a ppo checkpoint, or start it from the HF weights instead")
    _load_model(learner.policy, path / "policy")
    _load_model(learner.reference, path / "reference")
    if critic is not None:
        _load_model(critic.model, path / "critic")
        critic.load(state["critic"])
    learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    learner._set_rng_state(state["rng"])
    return int(state["weight_version"])


def write_hf_folder(hf_tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike,
                    base_model_dir: str | os.PathLike, max_shard_size: str = "5GB") -> None:
    """Write an HF model folder: ``hf_tensors`` as safetensors (sharded with an index by
    ``huggingface_hub.split_torch_state_dict_into_shards`` when above ``max_shard_size``) plus all
    non-weight files of ``base_model_dir`` (config.json, tokenizer files, chat template,
    generation_config.json). Atomic: written to a temporary sibling, then renamed.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    out, base = Path(out_dir), Path(base_model_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export_hf: {out} exists and is not empty; pass a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in base.iterdir():
            if f.is_file() and not f.name.startswith(".") and not f.name.endswith(_WEIGHT_PATTERNS):
                shutil.copy2(f, tmp / f.name)
        split = split_torch_state_dict_into_shards(hf_tensors, max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: hf_tensors[n] for n in names}, str(tmp / filename),
                      metadata={"format": "pt"})
        if split.is_sharded:
            import json

            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
