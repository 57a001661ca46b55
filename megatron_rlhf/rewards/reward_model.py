"""Reward-model scoring of chat completions: a causal-LM trunk with a scalar head.

:class:`RewardModel` loads either of two folder formats:

1. **HF sequence classification** (``num_labels=1``; ``AutoModelForSequenceClassification``, e.g.
   ``LlamaForSequenceClassification`` = the Llama trunk + a bias-free ``score`` linear layer
   ``[hidden] -> [1]``), e.g. a published reward model. The reward is the head applied to the
   trunk's final (normed) hidden state at the last real token.
2. **Pooled-feature head** (what ``tools/train_reward_model.py`` writes by default): an HF base
   trunk (``AutoModel``, e.g. ``LlamaModel`` cut to its first layers) plus ``reward_head.json``
   (a :class:`FeatureSpec` and the training ``max_length``) and ``reward_head.safetensors``
   (``mean [D]``, ``std [D]``, ``weight [D]`` float32). The reward is
   ``((f - mean) / std) @ weight`` with ``f = reward_features(...)  [D]``: for each listed hidden
   state, the state at the last token and/or the mean over the reply's tokens, optionally followed
   by ``log(1 + reply tokens)``. The training tool computes its features with the same
   :func:`reward_features`, so training and serving cannot drift apart.

Both formats read the sequence

    chat_template(prompt, add_generation_prompt=True) + completion.strip() + <eos>

(:func:`encode_for_reward`), cut from the left to ``max_length`` tokens, i.e. the
Bradley-Terry reward of Ouyang et al. 2022 (eq. 1) read at/around the end-of-turn token.
:class:`RewardModel` is a plain class; the trainer wraps it as a Ray actor
(``ray.remote(num_cpus=1)(RewardModel)``).

Also here: :class:`RunningRewardNormalizer` (per-task running mean/std, so that reward-model
scores of different tasks are on a common scale before pairing, issue 7) and
:func:`length_normalized_rewards` (for logging/checkpoint selection).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RewardModel", "RunningRewardNormalizer", "length_normalized_rewards", "bradley_terry_loss",
           "FeatureSpec", "reward_features", "encode_for_reward", "encode_reward_parts",
           "HEAD_CONFIG", "HEAD_WEIGHTS"]

HEAD_CONFIG = "reward_head.json"
"""File name of the pooled-feature head's JSON description (format 2 of the module docstring)."""
HEAD_WEIGHTS = "reward_head.safetensors"
"""File name of the pooled-feature head's tensors ``mean``, ``std``, ``weight`` (each ``[D]``)."""
HEAD_FORMAT = "megatron_rlhf.pooled_linear_reward_head/v1"
POOLINGS = ("last", "reply_mean")


def bradley_terry_loss(r_chosen, r_rejected):
    """Bradley-Terry pairwise loss ``mean(-log sigmoid(r_c - r_r))``.

    Args:
        r_chosen: ``[P]`` rewards of the preferred responses (float tensor).
        r_rejected: ``[P]`` rewards of the dispreferred responses.
    Returns:
        ``(loss, metrics)``: scalar loss (nats per pair, mean over P; computed as
        ``softplus(-(r_c - r_r))`` for stability) and ``{"rm/accuracy", "rm/margin"}`` floats
        (fraction with ``r_c > r_r``; mean ``r_c - r_r``).
    Raises:
        ValueError: shapes differ or are empty.
    Source: Bradley & Terry 1952; Ouyang et al. 2022, eq. 1 (the 1/C(K,2) factor is the mean).
    """
    import torch.nn.functional as F

    if r_chosen.shape != r_rejected.shape or r_chosen.numel() == 0:
        raise ValueError(f"bradley_terry_loss: r_chosen {tuple(r_chosen.shape)} and r_rejected "
                         f"{tuple(r_rejected.shape)} must have the same non-empty shape [P]")
    d = r_chosen - r_rejected
    loss = F.softplus(-d).mean()
    d = d.detach()
    return loss, {"rm/accuracy": float((d > 0).float().mean()), "rm/margin": float(d.mean())}


@dataclass(frozen=True)
class FeatureSpec:
    """Which trunk features a pooled-feature reward head reads.

    Attributes:
        layers: hidden-state indices, as in HF ``output_hidden_states``: ``0`` = token embeddings,
            ``l`` = the residual stream after ``l`` decoder layers, and the trunk's depth = its final
            normed output (``last_hidden_state``). Sorted, unique, each in ``[0, depth]``.
        poolings: subset of ``("last", "reply_mean")``: the state at the last real token (the
            end-of-turn token), and the mean over the reply's tokens that survive truncation
            (the eos included).
        length_feature: append ``log(1 + reply tokens)`` (untruncated reply incl. eos), a known
            signal of AI and human preference labels (longer answers win most AlpacaEval pairs)
            that the reward may use; report it.
        length_interactions: for each layer, also append ``log(1 + reply tokens)`` times the mean
            state over the prompt tokens that survive truncation (zeros when none do), so the
            prompt can decide whether a longer reply is better (in HH-harmless the shorter reply
            wins most pairs, in AlpacaEval the longer one).
    """

    layers: tuple[int, ...]
    poolings: tuple[str, ...] = ("last", "reply_mean")
    length_feature: bool = True
    length_interactions: bool = False

    def __post_init__(self):
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or min(self.layers) < 0:
            raise ValueError(f"feature layers {self.layers}: need a sorted, unique, non-empty list of "
                             "hidden-state indices >= 0")
        if not self.poolings or any(p not in POOLINGS for p in self.poolings) or len(set(self.poolings)) != len(self.poolings):
            raise ValueError(f"poolings {self.poolings}: need a non-empty subset of {POOLINGS}")

    def dim(self, hidden_size: int) -> int:
        """Feature width ``D = len(layers) * (len(poolings) + length_interactions) * hidden_size + length_feature``."""
        per_layer = len(self.poolings) + int(self.length_interactions)
        return len(self.layers) * per_layer * hidden_size + int(self.length_feature)

    @property
    def needs_reply(self) -> bool:
        """Whether features depend on where the reply starts (reply lengths must be given)."""
        return self.length_feature or self.length_interactions or "reply_mean" in self.poolings

    def to_dict(self) -> dict:
        """JSON-able form (inverse of :meth:`from_dict`)."""
        return {"layers": list(self.layers), "poolings": list(self.poolings), "length_feature": self.length_feature,
                "length_interactions": self.length_interactions}

    @classmethod
    def from_dict(cls, d: dict) -> FeatureSpec:
        """Build from :meth:`to_dict` output. Raises ValueError/KeyError on a malformed dict."""
        return cls(tuple(int(x) for x in d["layers"]), tuple(d["poolings"]), bool(d["length_feature"]),
                   bool(d.get("length_interactions", False)))


def reward_features(trunk, input_ids, attention_mask, reply_tokens, spec: FeatureSpec):
    """Pooled trunk features of a right-padded batch, the input of a pooled-feature reward head.

    Args:
        trunk: an HF base model (``AutoModel``, e.g. ``LlamaModel``) of depth ``>= max(spec.layers)``
            accepting ``output_hidden_states=True``.
        input_ids: ``[B, S]`` int64, right-padded.
        attention_mask: ``[B, S]`` 1 on real tokens (a prefix of each row), 0 on padding.
        reply_tokens: ``[B]`` int64, reply length in tokens (completion + eos) *before* truncation;
            the reply occupies the last ``min(reply_tokens, n_b)`` real tokens of row ``b``.
        spec: which layers/poolings (see :class:`FeatureSpec`).
    Returns:
        ``[B, D]`` float32 (``D = spec.dim(hidden)``), ordered layer-major (poolings, then the
        length interaction), then the length feature.
    Raises:
        ValueError: a layer index exceeds the trunk depth or a reply length is < 1.
    Source: last-token pooling = HF ``*ForSequenceClassification``; mean pooling over the response
    tokens and multi-layer probing, e.g. Zou et al. 2023 (representation engineering).
    """
    import torch

    depth = trunk.config.num_hidden_layers
    if max(spec.layers) > depth:
        raise ValueError(f"feature layers {spec.layers}: the trunk has only {depth} layers")
    reply_tokens = reply_tokens.to(input_ids.device).long()
    if (reply_tokens < 1).any():
        raise ValueError("reply_tokens: every reply has >= 1 token (its eos)")
    mask = attention_mask.long()
    out = trunk(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states
    n = mask.sum(-1)  # [B]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    start = (n - reply_tokens).clamp_min(0)
    reply = ((pos[None, :] >= start[:, None]) & (pos[None, :] < n[:, None])).to(hs[0].dtype)  # [B, S]
    prompt = (pos[None, :] < start[:, None]).to(hs[0].dtype)  # [B, S] surviving prompt tokens
    log_len = torch.log1p(reply_tokens.to(hs[0].dtype))[:, None]  # [B, 1]
    feats = []
    for layer in spec.layers:
        h = out.last_hidden_state if layer == depth else hs[layer]
        for p in spec.poolings:
            if p == "last":
                feats.append(h[rows, n - 1])
            else:
                feats.append((h * reply[..., None]).sum(1) / reply.sum(1, keepdim=True))
        if spec.length_interactions:
            feats.append(log_len * (h * prompt[..., None]).sum(1) / prompt.sum(1, keepdim=True).clamp_min(1))
    if spec.length_feature:
        feats.append(log_len)
    return torch.cat(feats, -1).float()


class RewardModel:
    """Batched scalar rewards from a reward-model folder (either format of the module docstring).

    Args:
        model_dir: HF sequence-classification folder (``num_labels == 1``) or a pooled-feature
            head folder (trunk + ``reward_head.json`` + ``reward_head.safetensors``); both with a
            tokenizer that has a chat template.
        dtype: ``float32`` (CPU) or ``bfloat16``.
        device: torch device string (``cpu`` or ``cuda``).
        batch_size: sequences per forward pass.
        max_length: sequences longer than this are cut from the left (the completion's end and
            the end-of-turn token are kept); counted in ``self.num_truncated``. ``None``: the
            ``max_length`` the pooled head was trained with (so serving features match training),
            else 1024.
    Raises:
        ValueError: the folder is missing, has no scalar head (``num_labels != 1`` and no
            ``reward_head.json``), a malformed head, or no chat template.
    """

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 batch_size: int = 8, max_length: int | None = None):
        import torch
        from transformers import AutoConfig, AutoTokenizer

        d = Path(model_dir).expanduser()
        if not (d / "config.json").is_file():
            raise ValueError(f"reward_model={str(model_dir)!r}: no config.json there; give a folder "
                             "written by tools/train_reward_model.py or an HF sequence-classification model")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={dtype!r}: expected float32 or bfloat16")
        self.head_spec: FeatureSpec | None = None
        trained_len = None
        if (d / HEAD_CONFIG).is_file():
            self._load_pooled_head(d, getattr(torch, dtype), device)
            trained_len = self.head_config.get("max_length")
        else:
            cfg = AutoConfig.from_pretrained(d)
            if getattr(cfg, "num_labels", None) != 1:
                raise ValueError(f"reward_model={str(model_dir)!r}: num_labels={cfg.num_labels}, expected 1 "
                                 f"(a scalar reward head), and there is no {HEAD_CONFIG}")
            from transformers import AutoModelForSequenceClassification

            self.model = AutoModelForSequenceClassification.from_pretrained(
                d, dtype=getattr(torch, dtype)).to(device).eval()
            if not hasattr(self.model, "score"):
                raise ValueError(f"reward_model={str(model_dir)!r}: {type(self.model).__name__} has no "
                                 "'score' head; use a Llama/Qwen/Mistral-style sequence-classification model")
            self.trunk = getattr(self.model, self.model.base_model_prefix)
        if max_length is None:
            max_length = int(trained_len) if trained_len else 1024
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size={batch_size}, max_length={max_length}: need >= 1 and >= 2")
        self.tokenizer = AutoTokenizer.from_pretrained(d)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward_model={str(model_dir)!r}: the tokenizer has no chat template")
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.eos_id = self.tokenizer.eos_token_id
        self.num_truncated = 0
        self.num_scored = 0

    def _load_pooled_head(self, d: Path, dtype, device: str) -> None:
        """Load format 2: the ``AutoModel`` trunk, :class:`FeatureSpec` and the linear head tensors."""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel

        try:
            self.head_config = json.loads((d / HEAD_CONFIG).read_text())
            if self.head_config.get("format") != HEAD_FORMAT:
                raise ValueError(f"format {self.head_config.get('format')!r}, expected {HEAD_FORMAT!r}")
            self.head_spec = FeatureSpec.from_dict(self.head_config["features"])
            t = load_file(str(d / HEAD_WEIGHTS))
            mean, std, weight = (t[k].float() for k in ("mean", "std", "weight"))
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"reward_model={str(d)!r}: malformed {HEAD_CONFIG}/{HEAD_WEIGHTS} ({e}); "
                             "rewrite it with tools/train_reward_model.py") from e
        self.model = AutoModel.from_pretrained(d, dtype=dtype).to(device).eval()
        self.trunk = self.model
        want = self.head_spec.dim(self.model.config.hidden_size)
        if not mean.shape == std.shape == weight.shape == (want,):
            raise ValueError(f"reward_model={str(d)!r}: head tensors {tuple(weight.shape)} do not match the "
                             f"{want} features of {self.head_spec}")
        # reward = ((f - mean) / std) @ weight = f @ (weight / std) - const; the constant is kept so
        # rewards equal the training tool's exactly, not only their differences
        self._head_w = (weight / std).to(device)
        self._head_b = float(-(mean / std * weight).sum())

    # ------------------------------------------------------------------ public verbs
    def score(self, prompts: Sequence, completions: Sequence[str]) -> list[float]:
        """Rewards of ``completions[i]`` as replies to ``prompts[i]``.

        Args:
            prompts: per item either chat messages (``list[{"role", "content"}]``, the last from the
                user), a plain user string, or prompt token ids (``Sequence[int]``, chat template
                and generation prompt already applied, e.g. ``Prompt.token_ids``; only valid when
                the reward model shares the policy's tokenizer).
            completions: reply texts (no template tokens), same length as ``prompts``.
        Returns:
            ``len(prompts)`` floats (reward units of the head: logits of a Bradley-Terry model, only
            differences are meaningful). Deterministic; batched and one-by-one results agree to
            float rounding.
        Raises:
            ValueError: lengths differ or a prompt has an unsupported type.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"score: {len(prompts)} prompts but {len(completions)} completions")
        parts = [encode_reward_parts(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        return self.score_token_ids([p + r for p, r in parts], reply_lengths=[len(r) for _, r in parts])

    def encode(self, prompt, completion: str) -> list[int]:
        """Token ids the reward is read from: ``template(prompt) + completion.strip() + [eos]``.

        Returns:
            ``[seq_len]`` ids (not yet truncated). The training tool uses this same function.
        Raises:
            ValueError: unsupported ``prompt`` type.
        """
        return encode_for_reward(self.tokenizer, prompt, completion)

    def score_token_ids(self, sequences: Sequence[Sequence[int]],
                        reply_lengths: Sequence[int] | None = None) -> list[float]:
        """Rewards of already-encoded sequences (see :meth:`encode`).

        Args:
            sequences: token id lists, each ending with the reply's eos.
            reply_lengths: per sequence, how many trailing tokens are the reply (completion + eos),
                counted before truncation. Required by pooled heads that use the reply
                (``reply_mean`` pooling or the length feature); ignored by sequence-classification
                models.
        Returns:
            ``len(sequences)`` floats in input order. Sequences are sorted by length,
            right-padded, run in batches of ``batch_size`` and cut from the left to ``max_length``.
        Raises:
            ValueError: an empty sequence, or ``reply_lengths`` missing/mismatched when needed.
        """
        import torch

        spec = self.head_spec
        needs_reply = spec is not None and spec.needs_reply
        if needs_reply and (reply_lengths is None or len(reply_lengths) != len(sequences)):
            raise ValueError("score_token_ids: this reward head pools over the reply; pass reply_lengths "
                             "(one per sequence: completion tokens + 1 for the eos), or use score()")
        r = self._batched(sequences, reply_lengths, self.rewards)
        self.num_scored += len(sequences)
        return [float(x) for x in r]

    def features(self, prompts: Sequence, completions: Sequence[str]):
        """Pooled-head input features of (prompt, completion) pairs, exactly as scored.

        Args:
            prompts, completions: as in :meth:`score`.
        Returns:
            ``[N, D]`` float32 tensor (:func:`reward_features`, after truncation to ``max_length``).
        Raises:
            ValueError: the folder is a sequence-classification model (no pooled head), or
                lengths differ.
        """
        if self.head_spec is None:
            raise ValueError("features: only pooled-feature reward heads (reward_head.json) have features")
        if len(prompts) != len(completions):
            raise ValueError(f"features: {len(prompts)} prompts but {len(completions)} completions")
        parts = [encode_reward_parts(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        return self._batched([p + r for p, r in parts], [len(r) for _, r in parts],
                             lambda ids, mask, reps: reward_features(self.trunk, ids, mask, reps, self.head_spec))

    def _batched(self, sequences, reply_lengths, fn):
        """Cut to ``max_length`` from the left, sort by length, right-pad, run ``fn(ids, mask, reply
        [B])`` per batch of ``batch_size`` without gradients; returns the row outputs stacked
        ``[N, ...]`` in input order (CPU)."""
        import torch

        seqs = []
        for s in sequences:
            s = list(s)
            if len(s) > self.max_length:
                s = s[-self.max_length:]
                self.num_truncated += 1
            if not s:
                raise ValueError("score_token_ids: empty sequence")
            seqs.append(s)
        if not seqs:
            return torch.zeros(0)
        reps = list(reply_lengths) if reply_lengths is not None else [1] * len(seqs)
        out: list = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        with torch.no_grad():
            for b in range(0, len(order), self.batch_size):
                idx = order[b:b + self.batch_size]
                ids, mask = pad_right([seqs[i] for i in idx], self.pad_id)
                r = fn(ids.to(self.device), mask.to(self.device),
                       torch.tensor([reps[i] for i in idx], dtype=torch.long))
                for j, i in enumerate(idx):
                    out[i] = r[j].float().cpu()
        return torch.stack(out)

    def rewards(self, input_ids, attention_mask, reply_tokens=None):
        """Rewards of a right-padded batch.

        Args:
            input_ids: ``[B, S]`` int64, right-padded.
            attention_mask: ``[B, S]`` 1 on real tokens (a prefix of each row), 0 on padding.
            reply_tokens: ``[B]`` int64 untruncated reply lengths (pooled heads only, see
                :func:`reward_features`).
        Returns:
            ``[B]`` float32. Sequence-classification format: ``score(h[b, last_b])`` with ``h`` the
            trunk's final (normed) hidden states ``[B, S, H]`` and ``last_b = attention_mask[b].sum() - 1``
            (equals the HF ``AutoModelForSequenceClassification`` logits when the pad id never occurs
            in the rows). Pooled format: ``reward_features(...) @ (weight / std) - (mean / std) @ weight``.
        """
        import torch

        if self.head_spec is not None:
            if reply_tokens is None:
                raise ValueError("rewards: a pooled reward head needs reply_tokens [B]")
            f = reward_features(self.trunk, input_ids, attention_mask, reply_tokens, self.head_spec)
            return f @ self._head_w + self._head_b
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.long().sum(-1) - 1
        pooled = h[torch.arange(h.shape[0], device=h.device), last]
        return self.model.score(pooled).squeeze(-1).float()

    @property
    def pad_id(self) -> int:
        """Padding id for batches (never read: pooling uses the attention mask)."""
        p = self.model.config.pad_token_id
        return int(p if p is not None else (self.eos_id or 0))


def encode_reward_parts(tokenizer, prompt, completion: str) -> tuple[list[int], list[int]]:
    """``(prompt ids, reply ids)`` with ``prompt ids + reply ids == encode_for_reward(...)``.

    The prompt part is ``chat_template(prompt, add_generation_prompt=True)`` (or the given ids), the
    reply part ``completion.strip()`` tokenised alone plus ``[eos]`` (so ``len(reply ids) >= 1``).

    Args:
        tokenizer: HF tokenizer with a chat template and an ``eos_token_id`` (end of turn).
        prompt: chat messages, a user string, or prompt token ids (template already applied).
        completion: reply text.
    Raises:
        ValueError: unsupported ``prompt`` type, or the tokenizer has no eos token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the reward model tokenizer has no eos_token (the end-of-turn token the reward "
                         "is read at)")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        p_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    elif isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
        p_ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"prompt of type {type(prompt).__name__}: expected chat messages "
                         "(list of {'role','content'} dicts), a string, or token ids")
    c_ids = list(tokenizer(completion.strip(), add_special_tokens=False)["input_ids"])
    return p_ids, c_ids + [int(tokenizer.eos_token_id)]


def encode_for_reward(tokenizer, prompt, completion: str) -> list[int]:
    """``chat_template(prompt, add_generation_prompt=True) + completion.strip() + [eos]`` as ids.

    Args:
        tokenizer: HF tokenizer with a chat template and an ``eos_token_id`` (end of turn).
        prompt: chat messages, a user string, or prompt token ids (template already applied).
        completion: reply text.
    Returns:
        ``[seq_len]`` token ids (see :func:`encode_reward_parts` for the split).
    Raises:
        ValueError: unsupported ``prompt`` type, or the tokenizer has no eos token.
    """
    p, r = encode_reward_parts(tokenizer, prompt, completion)
    return p + r


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int):
    """Right-pad id lists into ``(input_ids [B, S] int64, attention_mask [B, S] int64)``."""
    import torch

    s = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), s), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(list(x), dtype=torch.long)
        mask[i, :len(x)] = 1
    return ids, mask


class RunningRewardNormalizer:
    """Per-task running mean and standard deviation of rewards, for ``(r - mean) / (std + eps)``.

    Reward-model scores have arbitrary offset and scale, and differ between tasks; normalising
    each task's rewards by its own running statistics puts tasks on one scale before pairing or
    logging (issue 7). Statistics merge batches exactly (Chan, Golub & LeVeque 1979 parallel
    variance; Welford 1962), so the result does not depend on how rewards were batched.

    Args:
        eps: added to the std in :meth:`normalize` (reward units).
    """

    def __init__(self, eps: float = 1e-6):
        if not eps > 0:
            raise ValueError(f"eps={eps}: must be > 0")
        self.eps = eps
        self._stats: dict[str, tuple[int, float, float]] = {}  # task -> (count, mean, M2)

    def update(self, task: str, rewards: Sequence[float]) -> None:
        """Fold a batch of finite rewards of ``task`` into its statistics (non-finite ones are ignored)."""
        xs = [float(r) for r in rewards if math.isfinite(r)]
        if not xs:
            return
        nb = len(xs)
        mb = sum(xs) / nb
        m2b = sum((x - mb) ** 2 for x in xs)
        na, ma, m2a = self._stats.get(task, (0, 0.0, 0.0))
        n = na + nb
        delta = mb - ma
        self._stats[task] = (n, ma + delta * nb / n, m2a + m2b + delta * delta * na * nb / n)

    def stats(self, task: str) -> tuple[int, float, float]:
        """``(count, mean, std)`` of ``task`` (population std; ``(0, 0.0, 1.0)`` before any update)."""
        n, m, m2 = self._stats.get(task, (0, 0.0, 0.0))
        return (n, m, math.sqrt(m2 / n)) if n else (0, 0.0, 1.0)

    def normalize(self, task: str, rewards: Sequence[float]) -> list[float]:
        """``(r - mean) / (std + eps)`` with the task's current statistics (call :meth:`update` first).

        Raises:
            KeyError: no reward of ``task`` was seen yet.
        """
        if task not in self._stats:
            raise KeyError(f"RunningRewardNormalizer: no rewards of task {task!r} seen yet; call update() first")
        _, m, s = self.stats(task)
        return [(float(r) - m) / (s + self.eps) for r in rewards]

    def state_dict(self) -> dict:
        """Checkpointable state: ``{"eps", "stats": {task: [count, mean, M2]}}``."""
        return {"eps": self.eps, "stats": {k: list(v) for k, v in self._stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.eps = float(state["eps"])
        self._stats = {k: (int(v[0]), float(v[1]), float(v[2])) for k, v in state["stats"].items()}


def length_normalized_rewards(rewards: Sequence[float], lengths: Sequence[int]) -> list[float]:
    """Reward per completion token, ``r_i / max(len_i, 1)``, for logging next to the raw reward.

    A reward model that favours long answers lets the policy raise its reward by writing more;
    logging a length-normalised reward alongside the raw one exposes that when choosing
    checkpoints (Lanchantin et al. 2025, sec. 4.2, as cited by issue 7). Only meaningful for
    rewards on a common scale (e.g. after :class:`RunningRewardNormalizer`).

    Args:
        rewards: ``[N]`` rewards (reward units).
        lengths: ``[N]`` completion lengths in tokens.
    Returns:
        ``[N]`` rewards per token.
    Raises:
        ValueError: lengths differ or a length is negative.
    """
    if len(rewards) != len(lengths):
        raise ValueError(f"length_normalized_rewards: {len(rewards)} rewards but {len(lengths)} lengths")
    if any(n < 0 for n in lengths):
        raise ValueError("length_normalized_rewards: lengths must be >= 0 tokens")
    return [float(r) / max(int(n), 1) for r, n in zip(rewards, lengths)]
