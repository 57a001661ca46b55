"""Reward-model training (Bradley-Terry, CPU-friendly) and the demo reward models built on first use.

Public verbs:

* :func:`resolve_reward_model` -- ``tasks[].reward.reward_model`` (a demo name or a folder) -> the
  folder to load with :class:`~megatron_rlhf.rewards.reward_model.RewardModel`; a demo name
  (:data:`DEMO_REWARD_MODELS`, e.g. ``smollm2-demo``) is trained once and cached under
  ``<model.cache_dir>/reward_models/`` (:func:`ensure_demo_reward_model`).
* :func:`train_reward_model` -- train, evaluate and save one (``tools/train_reward_model.py`` is its CLI).

What training does (honest summary):

* Model: the base causal LM's trunk (``AutoModel``; default SmolLM2-135M-Instruct via
  ``megatron_rlhf.convert.gguf.ensure_smollm2_hf``) cut to its first ``layers`` layers (0 = all),
  frozen, and a linear head on features (``megatron_rlhf.rewards.reward_model.reward_features``, the
  function the serving ``RewardModel`` uses too; see ``FeatureSpec``): the ``feature_layers``
  hidden states at the end-of-turn token (``poolings``) of the sequence's last ``max_len``
  tokens; the mean input embedding of the whole reply; ``log(1 + reply tokens)``; and that
  log-length times the prompt's mean input embedding (so the prompt decides whether longer is
  better). Reply length is a real signal of these labels -- the longer reply wins ~69% of
  AlpacaEval and ~63% of DOVE pairs but only ~44% of HH-harmless pairs -- and the report states
  the "longer reply wins" baseline next to the model's accuracy.
* Why this design: a full fine-tune costs ~2 s per forward+backward of 4x69 tokens on 2 CPU cores.
  Measured on the default split (n = 500 held out, seed 0; 0.58 = "longer wins"): a linear head on
  8-layer, 128-token last-token features from 1,000 pairs reached only 0.56; deeper or more layers,
  mean pooling and a bare length feature did not help at that size; what helped was training on
  every pair (~6,100) and the length x prompt interaction, which together need a cheap trunk.
* Fitting: the trunk's features are extracted once (forward only), cached as safetensors keyed by
  (base model, layers, feature spec, data files, max length, encoding); the head minimises the
  Bradley-Terry loss ``-log sigmoid(r_c - r_r)`` (Bradley & Terry 1952; Ouyang et al. 2022 eq. 1)
  + L2 on standardised features (logistic regression on feature differences, full-batch L-BFGS);
  the L2 strength is chosen by group-wise 4-fold cross-validation on the training pairs only (the
  held-out split is never used to choose anything).
* Data: preference files (``hh_rlhf``, ``dove``, ``alpaca_eval`` formats, see
  ``megatron_rlhf.data.preferences``), default ``data/preferences`` in the repo (the MIT-licensed
  HH-RLHF harmless-base and DOVE HH-helpful pairs; other folders, e.g. ``../shared/data/preferences``
  with its CC BY-NC AlpacaEval pairs, are passed with ``data=``) relative to the repo
  (AlpacaEval annotations are CC BY-NC 4.0: read there, never copied); ``sources`` keeps some
  formats. Split by prompt group with a fixed seed so no prompt is on both sides.
* Output (written into a temporary sibling folder and renamed into place, ``rm_report.json``
  last, so a crash never leaves a half folder that later counts as complete): the trunk (HF
  ``AutoModel`` folder + tokenizer with chat template) and the head (``reward_head.json``: feature
  spec, max length, held-out summary; ``reward_head.safetensors``: ``mean``, ``std``, ``weight``),
  loaded by ``RewardModel``; and ``rm_report.json`` (n, held-out pairwise accuracy, its standard
  error sqrt(p(1-p)/n), per-source accuracy and length baselines, CV scores, timings incl. CPU
  seconds, cache path). The saved folder is reloaded and a few held-out pairs are re-scored from
  their text, checking that serving features and rewards equal the training ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_DATA", "DEFAULTS", "DEMO_REWARD_MODELS", "DemoRewardModel", "REPORT",
           "resolve_reward_model", "ensure_demo_reward_model", "train_reward_model", "build_pairs",
           "cache_key", "extract_features", "fit_head", "choose_weight_decay", "accuracy_se",
           "resolve_base", "reload_check"]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO / "data" / "preferences"
"""Default preference data: ``data/preferences`` in the repo (MIT: 2,312 HH-RLHF harmless-base and 363
DOVE HH-helpful pairs; see its README), so a fresh clone trains the demo reward model by itself."""
ENCODING_VERSION = "v2:template+strip+eos,left-trunc,reply-len"
DEFAULTS = dict(train_pairs=0, eval_pairs=500, max_len=64, layers=2, feature_layers=(2,), poolings=("last",),
                reply_embedding_mean=True, length_feature=True, length_x_prompt_embedding=True)
"""Defaults of the CPU demo's reward model (see the README section on the reward model)."""
REPORT = "rm_report.json"
"""The training report; written last, so its presence marks a complete reward-model folder."""
_RM_MARKERS = (REPORT, "reward_head.json")


# ----------------------------------------------------------------------------- demo models by name
GOLD_LAYERS = 12
"""Trunk depth of the demo's evaluation ("gold") reward model, ``smollm2-demo-gold``."""


@dataclass(frozen=True, kw_only=True)
class DemoRewardModel:
    """A reward model known by name, trained on first use and cached.

    Attributes:
        name: the ``tasks[].reward.reward_model`` value that selects it.
        folder: cache folder name under ``<cache_dir>/reward_models``.
        train_kwargs: arguments of :func:`train_reward_model` (besides ``out`` and ``cache_dir``);
            ``data`` absent = :data:`DEFAULT_DATA`.
        description: one line for logs and errors.
    """

    name: str
    folder: str
    train_kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""


DEMO_REWARD_MODELS: dict[str, DemoRewardModel] = {
    "smollm2-demo": DemoRewardModel(
        name="smollm2-demo", folder="smollm2-L2-T64-mit", train_kwargs=dict(base="smollm2", seed=0, **DEFAULTS),
        description="SmolLM2-135M-Instruct cut to 2 layers, 64 tokens, linear head on every pair of "
                    "the repo's data/preferences (MIT) but 500 held out"),
    "smollm2-demo-proxy": DemoRewardModel(
        name="smollm2-demo-proxy", folder="smollm2-L2-T64-mit-half-a",
        train_kwargs=dict(base="smollm2", seed=0, **{**DEFAULTS, "half": "a"}),
        description="as smollm2-demo, on half a of its training pairs (the demo trains against it)"),
    "smollm2-demo-gold": DemoRewardModel(
        name="smollm2-demo-gold", folder=f"smollm2-L{GOLD_LAYERS}-T64-mit-half-b",
        train_kwargs=dict(base="smollm2", seed=0, **{**DEFAULTS, "layers": GOLD_LAYERS,
                                                       "feature_layers": (GOLD_LAYERS,), "half": "b"}),
        description=f"SmolLM2-135M-Instruct cut to {GOLD_LAYERS} layers, on half b of the training pairs, "
                    "which share no prompt with half a (the demo evaluates with it, never trains against it)"),
}
"""Demo reward models by name (``tasks[].reward: {reward_model: smollm2-demo}``)."""


def resolve_reward_model(name_or_path: str, cache_dir: str | os.PathLike = "~/.cache/megatron_rlhf", *,
                         key: str = "reward_model") -> Path:
    """The folder of a reward model given by demo name or path, training a demo one on first use.

    Args:
        name_or_path: a key of :data:`DEMO_REWARD_MODELS` (e.g. ``smollm2-demo``) or a folder (``~``
            expanded; a relative path is looked up in the working directory, then the repo root)
            holding a ``config.json`` (an HF sequence-classification model with ``num_labels: 1``, or
            a pooled-feature head folder written by :func:`train_reward_model`).
        cache_dir: ``model.cache_dir``: demo models live in ``<cache_dir>/reward_models/<folder>``.
        key: the config key named in errors, e.g. ``tasks[chat].reward.reward_model``.
    Returns:
        The absolute folder path (not loaded: load it with ``RewardModel``).
    Raises:
        ValueError: the folder is missing, has no ``config.json`` or no scalar head
            (:func:`~megatron_rlhf.rewards.reward_model.scalar_head_problem`); or a demo model is not
            cached and its training data is missing (the message names ``key``, the value and the fix).
    """
    from megatron_rlhf.rewards.reward_model import scalar_head_problem

    if name_or_path in DEMO_REWARD_MODELS:
        return ensure_demo_reward_model(name_or_path, cache_dir, key=key)
    p = Path(os.path.expanduser(str(name_or_path)))
    candidates = [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, REPO / p]))
    for c in candidates:
        if (c / "config.json").is_file():
            problem = scalar_head_problem(c)
            if problem is not None:
                raise ValueError(f"{key} = {str(name_or_path)!r} is not a reward model ({c.resolve()}): {problem}")
            return c.resolve()
    where = " or ".join(str(c) for c in candidates)
    what = "has no config.json" if any(c.is_dir() for c in candidates) else "does not exist"
    raise ValueError(f"{key} = {str(name_or_path)!r}: the folder {what} (looked at {where}); give one of "
                     f"the demo names {sorted(DEMO_REWARD_MODELS)} (trained on first use) or a reward-model "
                     "folder written by tools/train_reward_model.py or an HF sequence-classification model "
                     "(num_labels: 1)")


def ensure_demo_reward_model(name: str, cache_dir: str | os.PathLike = "~/.cache/megatron_rlhf", *,
                             key: str = "reward_model") -> Path:
    """The cached folder of demo reward model ``name``, trained with :func:`train_reward_model` on first use.

    A folder counts as cached when it holds ``rm_report.json`` (written last, and the folder is
    published by an atomic rename). Training the default ``smollm2-demo`` takes a few minutes on
    2 CPU cores (features of ~2,700 pairs, cached under ``<cache_dir>/rm_features``, then the head).
    Concurrent callers may both train; the last rename wins and both get a complete folder.

    Args:
        name: a key of :data:`DEMO_REWARD_MODELS`.
        cache_dir: ``model.cache_dir`` (``~`` expanded).
        key: the config key named in errors.
    Returns:
        ``<cache_dir>/reward_models/<folder>`` (absolute).
    Raises:
        ValueError: unknown name, or not cached and its training data is missing.
    """
    if name not in DEMO_REWARD_MODELS:
        raise ValueError(f"{key} = {name!r} is not a demo reward model; known: {sorted(DEMO_REWARD_MODELS)}")
    spec = DEMO_REWARD_MODELS[name]
    cache = Path(os.path.expanduser(str(cache_dir))).resolve()
    out = cache / "reward_models" / spec.folder
    if (out / REPORT).is_file() and (out / "config.json").is_file():
        return out
    data = [Path(d) for d in (spec.train_kwargs.get("data") or [DEFAULT_DATA])]
    missing = [str(d) for d in data if not d.exists()]
    if missing:
        raise ValueError(f"{key} = {name!r}: not cached at {out}, and its training data {missing} is missing; "
                         "restore it (it is part of the repository: git checkout -- data/preferences) or give "
                         "a trained reward-model folder")
    log.warning("training demo reward model %r (%s) into %s; takes minutes on CPU, once",
                name, spec.description, out)
    train_reward_model(out=str(out), cache_dir=str(cache), **spec.train_kwargs)
    return out


# ----------------------------------------------------------------------------- training
def train_reward_model(*, out: str, base: str = "smollm2", data: list[str] | None = None,
                       train_pairs: int = DEFAULTS["train_pairs"], eval_pairs: int = DEFAULTS["eval_pairs"],
                       max_len: int = DEFAULTS["max_len"], layers: int = DEFAULTS["layers"],
                       feature_layers: tuple[int, ...] | None = DEFAULTS["feature_layers"],
                       poolings: tuple[str, ...] = DEFAULTS["poolings"],
                       reply_embedding_mean: bool = DEFAULTS["reply_embedding_mean"],
                       length_feature: bool = DEFAULTS["length_feature"],
                       length_x_prompt_embedding: bool = DEFAULTS["length_x_prompt_embedding"],
                       sources: tuple[str, ...] = (), half: str = "",
                       seed: int = 0, cache_dir: str = "~/.cache/megatron_rlhf",
                       feature_cache_dir: str | None = None, batch_size: int = 16, threads: int = 0,
                       wd_grid: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)) -> dict:
    """Train, evaluate and save a reward model (see the module docstring). Returns the report dict.

    ``train_pairs=0`` uses every pair not held out; ``half="a"`` or ``"b"`` trains on one of two
    halves of those that share no prompt (``megatron_rlhf.data.preferences.half_by_group``; the
    held-out pairs are the same for both halves, so a proxy and a gold model trained on the two
    halves are measured on one set); ``feature_layers=None`` means the trunk's last layer
    only, ``()`` no transformer layer (embedding and length features only). ``out`` is written
    atomically: into a temporary sibling folder, renamed into place once ``rm_report.json`` is
    written (an existing reward-model folder there is replaced; a crash leaves ``out`` as it was).

    Raises:
        ValueError: bad arguments (named), missing data or base model, or ``out`` is an existing
            non-empty folder that is not a reward-model folder (never overwritten).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    from megatron_rlhf.rewards.reward_model import HEAD_CONFIG, HEAD_FORMAT, HEAD_WEIGHTS, FeatureSpec

    t0, c0 = time.time(), time.process_time()
    out_dir = Path(os.path.expanduser(str(out))).resolve()
    _check_out(out_dir)
    if half not in ("", "a", "b"):
        raise ValueError(f"--half {half!r}: expected a or b (one of two prompt-disjoint halves of the "
                         "training pairs), or none for all of them")
    if not (train_pairs == 0 or train_pairs >= 8) or eval_pairs < 1 or max_len < 8 or layers < 0:
        raise ValueError(f"--train-pairs {train_pairs}, --eval-pairs {eval_pairs}, --max-len {max_len}, "
                         f"--layers {layers}: need 0 (all) or >= 8, >= 1, >= 8, >= 0")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    data = [str(d) for d in (data or [DEFAULT_DATA])]
    base_dir = resolve_base(base, cache_dir)
    tok = AutoTokenizer.from_pretrained(base_dir)
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # cutting the trunk to `layers` makes transformers list every
    try:                               # dropped layer's weights as "unexpected": expected here
        trunk = AutoModel.from_pretrained(base_dir, dtype=torch.float32,
                                          **({"num_hidden_layers": layers} if layers else {})).eval()
    finally:
        hf_logging.set_verbosity(level)
    n_layers = trunk.config.num_hidden_layers
    spec = FeatureSpec(tuple(feature_layers) if feature_layers is not None else (n_layers,), tuple(poolings),
                       reply_embedding_mean, length_feature, length_x_prompt_embedding)
    if spec.layers and max(spec.layers) > n_layers:
        raise ValueError(f"--feature-layers {list(spec.layers)}: the trunk keeps only --layers {n_layers}")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t_load = time.time() - t0

    from megatron_rlhf.data.preferences import find_preference_files

    files = [f.resolve() for d in data for f in find_preference_files(d)]
    train, ev, counts, truncated = build_pairs(tok, data, train_pairs, eval_pairs, max_len, seed, tuple(sources),
                                               half=half)
    key = cache_key(base_dir, n_layers, max_len, files, spec)
    fdir = Path(os.path.expanduser(feature_cache_dir or os.path.join(cache_dir, "rm_features")))
    cache_file = fdir / key / "features.safetensors"
    print(f"[rm] base {base_dir} ({n_layers} layers), features: {spec.describe()}; {len(train)} train / {len(ev)} eval "
          f"pairs, max_len {max_len} ({truncated} sequences cut), feature cache {cache_file}", flush=True)
    t1, c1 = time.time(), time.process_time()
    feats, computed = extract_features(trunk, train + ev, cache_file, pad_id, batch_size, spec, max_len)
    t_feat, c_feat = time.time() - t1, time.process_time() - c1

    def stack(pairs):
        return (torch.stack([feats[p["uid"]][0] for p in pairs]), torch.stack([feats[p["uid"]][1] for p in pairs]))

    xc, xr = stack(train)
    allx = torch.cat([xc, xr])
    mu, sd = allx.mean(0), allx.std(0).clamp_min(1e-6)
    zc, zr = (xc - mu) / sd, (xr - mu) / sd
    t2 = time.time()
    groups = [p["group"] for p in train]  # CV folds never split one prompt's pairs
    wd, cv = choose_weight_decay(zc, zr, groups, list(wd_grid), seed)
    w = fit_head(zc, zr, wd)
    t_fit = time.time() - t2

    def reward(x):
        return ((x - mu) / sd) @ w

    ec, er = stack(ev)
    rc, rr = reward(ec), reward(er)
    correct = rc > rr
    n, acc, se = accuracy_se(correct)
    # reference point: "the longer reply wins" (in characters), a known bias of AI judges
    longer_wins = sum(p["longer_chosen"] for p in ev) / len(ev)
    train_acc = float((reward(xc) > reward(xr)).float().mean())
    by_source = {}
    for s in sorted({p["source"] for p in ev}):
        m = torch.tensor([p["source"] == s for p in ev])
        ns, ps, ses = accuracy_se(correct[m])
        by_source[s] = {"n": ns, "accuracy": ps, "se": ses,
                        "longer_reply_wins": sum(p["longer_chosen"] for p in ev if p["source"] == s) / ns}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:  # written into a temporary sibling and renamed: a crash never leaves a half folder
        trunk.config.architectures = [type(trunk).__name__]
        trunk.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        save_file({"mean": mu.contiguous(), "std": sd.contiguous(), "weight": w.contiguous()}, str(tmp / HEAD_WEIGHTS))
        summary = {"n_eval": n, "accuracy": acc, "se": se, "seed": seed}
        (tmp / HEAD_CONFIG).write_text(json.dumps(
            {"format": HEAD_FORMAT, "features": spec.to_dict(), "max_length": max_len,
             "reward": "((features - mean) / std) @ weight", "trained_by": "megatron_rlhf.rewards.train",
             "held_out": summary}, indent=2))
        check = reload_check(tmp, ev[: min(6, len(ev))], feats, rc, rr)
        report = {
            "n_eval": n, "accuracy": acc, "se": se, "chance_z": (acc - 0.5) / math.sqrt(0.25 / n),
            "train_accuracy": train_acc, "baseline_longer_reply_wins": longer_wins, "n_train": len(train),
            "eval_by_source": by_source,
            "train_by_source": {s: sum(p["source"] == s for p in train) for s in sorted({p["source"] for p in train})},
            "weight_decay": wd, "cv_accuracy": {str(k): v for k, v in cv.items()},
            "length_weight_std_units": float(w[-1]) if spec.length_feature else None,
            "base": str(base_dir), "layers": n_layers, "features": spec.to_dict(), "feature_dim": int(w.numel()),
            "max_len": max_len, "seed": seed, "sources": list(sources) or "all", "half": half or "all",
            "train_groups_sha256": _groups_digest(train),
            "sequences_truncated": truncated, "data": data, "data_counts": counts,
            "feature_cache": str(cache_file), "features_computed": computed,
            "reload_check_max_abs_diff": check["reward"], "reload_check_feature_max_abs_diff": check["feature"],
            "time_s": {"load": round(t_load, 1), "features": round(t_feat, 1), "features_cpu": round(c_feat, 1),
                       "fit": round(t_fit, 1), "total": round(time.time() - t0, 1),
                       "total_cpu": round(time.process_time() - c0, 1), "threads": torch.get_num_threads()},
            "out": str(out_dir),
        }
        (tmp / REPORT).write_text(json.dumps(report, indent=2))   # written last: marks a complete folder
        _publish(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return report


# ----------------------------------------------------------------------------- data
def _groups_digest(pairs: list[dict]) -> str:
    """sha256 of the sorted prompt groups of ``pairs``: two reports whose training sides share no
    prompt have disjoint group sets (``rm_report.json`` records the digest; the test compares sets)."""
    return hashlib.sha256("\x1f".join(sorted({p["group"] for p in pairs})).encode()).hexdigest()


def build_pairs(tokenizer, data: list[str], num_train: int, num_eval: int, max_len: int, seed: int,
                sources: tuple[str, ...] = (), *, half: str = ""):
    """Load preference files, split by prompt group, and encode (chosen, rejected) token ids.

    Args:
        tokenizer: the base model's tokenizer (chat template).
        data: preference files or folders.
        num_train: training pairs kept (the first ``num_train`` of the shuffled training side; 0 = all).
        num_eval: held-out pairs (at least; whole prompt groups).
        max_len: sequences are cut from the left to this many tokens.
        seed: split seed.
        sources: keep only these formats (``hh_rlhf``/``dove``/``alpaca_eval``); empty = all.
        half: ``"a"``/``"b"``: keep that half of the training side
            (:func:`~megatron_rlhf.data.preferences.half_by_group`, before ``num_train``); ``""``: all.
    Returns:
        ``(train, eval, counts, truncated)``: lists of dicts ``{uid, source, group, prompt, chosen,
        rejected, chosen_ids, rejected_ids, chosen_reply, rejected_reply, longer_chosen}`` (whole
        ``prompt + reply`` ids, ``*_reply`` = reply tokens incl. eos), per-file counts, and the number
        of sequences longer than ``max_len`` (the trunk reads their last ``max_len`` tokens).
    Raises:
        ValueError: not enough pairs for ``num_train + num_eval``, or an unknown source.
    """
    from megatron_rlhf.data.preferences import (PREFERENCE_FORMATS, half_by_group, load_preference_files,
                                                split_by_group)
    from megatron_rlhf.rewards.reward_model import encode_reward_parts

    bad = [s for s in sources if s not in PREFERENCE_FORMATS]
    if bad:
        raise ValueError(f"--sources {bad}: expected names among {sorted(PREFERENCE_FORMATS)}")
    examples, counts = load_preference_files(data)
    if sources:
        examples = [e for e in examples if e.source in sources]
    if len(examples) < num_train + num_eval:
        raise ValueError(f"--train-pairs {num_train} + --eval-pairs {num_eval} exceed the {len(examples)} "
                         f"usable pairs in {data} (sources {list(sources) or 'all'})")
    train_ex, eval_ex = split_by_group(examples, num_eval, seed)
    if half:
        train_ex = half_by_group(train_ex, half, seed)
    train_ex = train_ex[:num_train] if num_train else train_ex
    digests: dict[str, str] = {}
    truncated = 0

    def enc(exs):
        # == encode_reward_parts(tokenizer, prompt, reply) per reply (the template is applied once per
        # pair and the replies are tokenised in one batched call, which is much faster)
        nonlocal truncated
        replies = tokenizer([r.strip() for ex in exs for r in (ex.chosen, ex.rejected)],
                            add_special_tokens=False)["input_ids"]
        eos = [int(tokenizer.eos_token_id)]
        outs = []
        for i, ex in enumerate(exs):
            if ex.file not in digests:
                digests[ex.file] = _sha256_file(Path(ex.file))[:16]
            out = {"uid": f"{digests[ex.file]}:{ex.index}", "source": ex.source, "group": ex.group,
                   "prompt": list(ex.prompt), "chosen": ex.chosen, "rejected": ex.rejected,
                   "longer_chosen": len(ex.chosen) > len(ex.rejected)}
            p_ids = encode_reward_parts(tokenizer, list(ex.prompt), "")[0]
            for j, key in enumerate(("chosen", "rejected")):
                r_ids = list(replies[2 * i + j]) + eos
                ids = p_ids + r_ids
                truncated += len(ids) > max_len
                out[key + "_ids"] = ids
                out[key + "_reply"] = len(r_ids)
            outs.append(out)
        return outs

    return enc(train_ex), enc(eval_ex), counts, truncated


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- features
def cache_key(base_dir: Path, layers: int, max_len: int, data_files: list[Path], spec) -> str:
    """Hex key of (base model config+weights, trunk depth, feature spec, max length, data, encoding)."""
    h = hashlib.sha256()
    h.update((base_dir / "config.json").read_bytes())
    for w in sorted(base_dir.glob("*.safetensors")):
        st = w.stat()
        h.update(f"{w.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(f"layers={layers};max_len={max_len};{ENCODING_VERSION};{json.dumps(spec.to_dict())}".encode())
    for f in sorted(data_files):
        h.update(_sha256_file(f).encode())
    return h.hexdigest()[:24]


def extract_features(trunk, pairs: list[dict], cache_file: Path, pad_id: int, batch_size: int, spec,
                     max_len: int) -> tuple[dict, int]:
    """:func:`reward_features` of every chosen/rejected sequence, cached on disk.

    Args:
        trunk: the (truncated) base model (``AutoModel``).
        pairs: dicts with ``uid``, ``{chosen,rejected}_ids`` and ``{chosen,rejected}_reply``.
        cache_file: safetensors file with tensors ``chosen``/``rejected`` ``[M, D]`` and metadata
            ``uids`` (JSON list); missing uids are computed and the file is rewritten atomically
            every minute and at the end, so an interrupted run resumes where it stopped.
        pad_id: right-padding id (pooling uses the attention mask, so its value does not matter).
        batch_size: sequences per forward pass.
        spec: the :class:`FeatureSpec`.
        max_len: the trunk reads each sequence's last ``max_len`` tokens.
    Returns:
        ``({uid: (chosen [D], rejected [D])}`` float32 tensors for every pair, number of pairs whose
        features were computed now (0 when everything came from the cache)).
    """
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_rlhf.rewards.reward_model import reward_features
    from megatron_rlhf.utils.progress import progress

    have: dict[str, tuple] = {}
    if cache_file.is_file():
        from safetensors import safe_open

        with safe_open(str(cache_file), "pt") as f:
            uids = json.loads(f.metadata()["uids"])
        t = load_file(str(cache_file))
        have = {u: (t["chosen"][i], t["rejected"][i]) for i, u in enumerate(uids)}
    todo = [p for p in pairs if p["uid"] not in have]
    seqs = [(p["uid"], k, p[k + "_ids"], p[k + "_reply"]) for p in todo for k in ("chosen", "rejected")]
    seqs.sort(key=lambda s: min(len(s[2]), max_len))
    got: dict[tuple, torch.Tensor] = {}

    def flush():
        """Move finished pairs into ``have`` and rewrite the cache atomically (safe to interrupt)."""
        done = [u for u in {u for u, _ in got} if (u, "chosen") in got and (u, "rejected") in got]
        for u in done:
            have[u] = (got.pop((u, "chosen")), got.pop((u, "rejected")))
        if not done:
            return
        uids = list(have)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        save_file({"chosen": torch.stack([have[u][0] for u in uids]).contiguous(),
                   "rejected": torch.stack([have[u][1] for u in uids]).contiguous()},
                  str(tmp), metadata={"uids": json.dumps(uids)})
        os.replace(tmp, cache_file)

    # to a pipe or a log file a plain line every 30 s (a bar's carriage returns pile up there)
    bar = progress(sum(min(len(s[2]), max_len) for s in seqs), "features", "tok", enabled=bool(seqs))
    last_flush = time.time()
    with torch.no_grad():
        for b in range(0, len(seqs), batch_size):
            chunk = seqs[b:b + batch_size]
            feats = reward_features(trunk, [s[2] for s in chunk], [s[3] for s in chunk], spec, max_len, pad_id)
            for (uid, k, _, _), f in zip(chunk, feats):
                got[(uid, k)] = f.clone()
            bar.update(sum(min(len(s[2]), max_len) for s in chunk))
            if time.time() - last_flush > 60:
                flush()
                last_flush = time.time()
    bar.close()
    flush()
    return {p["uid"]: have[p["uid"]] for p in pairs}, len(todo)


# ----------------------------------------------------------------------------- head
def fit_head(dc, dr, weight_decay: float, max_iter: int = 200):
    """Fit ``w`` minimising ``mean(softplus(-(dc - dr) @ w)) + wd/2 * |w|^2`` (BT loss + L2).

    Args:
        dc, dr: ``[N, D]`` standardised features of chosen / rejected replies.
        weight_decay: L2 strength (per pair-mean loss).
    Returns:
        ``w [D]`` float32.
    Source: logistic regression view of Bradley-Terry; torch.optim.LBFGS (strong Wolfe).
    """
    import torch

    from megatron_rlhf.rewards.reward_model import bradley_terry_loss

    w = torch.zeros(dc.shape[1], dtype=torch.float64, requires_grad=True)
    dc64, dr64 = dc.double(), dr.double()
    opt = torch.optim.LBFGS([w], max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-9)

    def closure():
        opt.zero_grad()
        loss, _ = bradley_terry_loss(dc64 @ w, dr64 @ w)
        loss = loss + 0.5 * weight_decay * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().float()


def choose_weight_decay(dc, dr, groups: list[str], grid: list[float], seed: int, folds: int = 4):
    """Group-wise k-fold cross-validation of the L2 strength on training pairs only.

    Args:
        dc, dr: ``[N, D]`` standardised training features (chosen / rejected).
        groups: ``[N]`` prompt-group keys (a group never straddles folds).
        grid: candidate L2 strengths.
        seed: fold-assignment seed.
        folds: number of folds.
    Returns:
        ``(best_wd, {wd: mean held-out-fold accuracy})`` (ties go to the larger, smoother wd).
    """
    import torch

    keys = sorted(set(groups))
    random.Random(seed).shuffle(keys)
    fold_of = {k: i % folds for i, k in enumerate(keys)}
    fold = torch.tensor([fold_of[g] for g in groups])
    scores = {}
    for wd in grid:
        accs = []
        for k in range(folds):
            tr, te = fold != k, fold == k
            if not te.any() or not tr.any():
                continue
            w = fit_head(dc[tr], dr[tr], wd)
            accs.append(float(((dc[te] - dr[te]) @ w > 0).float().mean()))
        scores[wd] = sum(accs) / len(accs)
    best = max(grid, key=lambda wd: (scores[wd], wd))
    return best, scores


def accuracy_se(correct) -> tuple[int, float, float]:
    """``(n, p, sqrt(p(1-p)/n))`` of a boolean tensor of pairwise correctness."""
    n = int(correct.numel())
    p = float(correct.float().mean()) if n else float("nan")
    return n, p, math.sqrt(p * (1 - p) / n) if n else float("nan")


def resolve_base(base: str, cache_dir: str) -> Path:
    """``smollm2`` -> the cached SmolLM2-135M-Instruct HF folder; else an existing HF folder.

    Raises:
        ValueError: ``base`` is neither ``smollm2`` nor a folder with a config.json.
    """
    if base == "smollm2":
        from megatron_rlhf.convert.gguf import ensure_smollm2_hf

        return ensure_smollm2_hf(cache_dir)
    p = Path(base).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"--base {base!r}: expected 'smollm2' or a local HF causal-LM folder with config.json")
    return p


def reload_check(out_dir: Path, pairs: list[dict], feats: dict, rc, rr) -> dict:
    """Serving vs training on ``pairs``: reload ``out_dir`` with ``RewardModel`` and score from text.

    Returns:
        ``{"feature": max |RewardModel.features - cached training features|, "reward": max |RewardModel.score
        - training-time reward|}`` (feature units / reward units); raises nothing, the caller reports it.
    """
    import torch

    from megatron_rlhf.rewards.reward_model import RewardModel

    rm = RewardModel(out_dir, batch_size=4)
    prompts = [p["prompt"] for p in pairs] * 2
    replies = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    got_f = rm.features(prompts, replies)
    want_f = torch.stack([feats[p["uid"]][0] for p in pairs] + [feats[p["uid"]][1] for p in pairs])
    got = rm.score(prompts, replies)
    want = [float(x) for x in rc[: len(pairs)]] + [float(x) for x in rr[: len(pairs)]]
    return {"feature": float((got_f - want_f).abs().max()), "reward": max(abs(a - b) for a, b in zip(got, want))}


# ----------------------------------------------------------------------------- output folder
def _check_out(out_dir: Path) -> None:
    """Refuse (before any work) an ``out`` that exists and is neither empty nor a reward-model folder."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out={str(out_dir)!r} is a file; give a folder path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not any((out_dir / m).is_file() for m in _RM_MARKERS):
        raise ValueError(f"out={str(out_dir)!r} is a non-empty folder that is not a reward-model folder "
                         f"(no {' or '.join(_RM_MARKERS)}); it is never overwritten: give a new folder")


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` folder to ``out_dir``, replacing a reward-model folder there."""
    from megatron_rlhf.convert.hf_io import apply_umask_permissions

    apply_umask_permissions(tmp)  # mkdtemp makes it 0700, safetensors files 0600
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
        os.replace(out_dir, old / "x")
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not (out_dir / REPORT).is_file():  # not a concurrent trainer's complete folder
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
