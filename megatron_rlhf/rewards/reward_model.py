"""Reward-model scoring of chat completions: a causal-LM trunk with a scalar head.

:class:`RewardModel` loads either of two folder formats:

1. **HF sequence classification** (``num_labels=1``; ``AutoModelForSequenceClassification``, e.g.
   ``LlamaForSequenceClassification`` = the Llama trunk + a bias-free ``score`` linear layer
   ``[hidden] -> [1]``), e.g. a published reward model. The reward is the head applied to the
   trunk's final (normed) hidden state at the last real token.
2. **Pooled-feature head** (what ``tools/train_reward_model.py`` writes): an HF base trunk
   (``AutoModel``, e.g. ``LlamaModel`` cut to its first layers) plus ``reward_head.json`` (a
   :class:`FeatureSpec` and the training ``max_length``) and ``reward_head.safetensors``
   (``mean [D]``, ``std [D]``, ``weight [D]`` float32). The reward is
   ``((f - mean) / std) @ weight`` with ``f = reward_features(...)  [D]``: trunk states at the
   end-of-turn token (and/or means over the reply) of chosen layers, the mean input embedding of
   the whole reply, ``log(1 + reply tokens)`` and its product with the prompt's mean input
   embedding (see :class:`FeatureSpec`). The training tool computes its features with the same
   :func:`reward_features`, so training and serving cannot drift apart.

Both formats read the sequence

    chat_template(prompt, add_generation_prompt=True) + completion.strip() + <eos>

(:func:`encode_for_reward`); the transformer reads its last ``max_length`` tokens. The scalar is a
Bradley-Terry reward (Ouyang et al. 2022, eq. 1): only differences between replies are meaningful.
:class:`RewardModel` is a plain class; the trainer wraps it as a Ray actor
(``ray.remote(num_cpus=1)(RewardModel)``).

Also here: :class:`RunningRewardNormalizer` (per-task running mean/std, so that reward-model
scores of different tasks are on a common scale before pairing, issue 7) and
:func:`length_normalized_rewards` (for logging/checkpoint selection).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RewardModel", "RunningRewardNormalizer", "length_normalized_rewards", "bradley_terry_loss",
           "FeatureSpec", "reward_features", "encode_for_reward", "encode_reward_parts",
           "HEAD_CONFIG", "HEAD_WEIGHTS", "scalar_head_problem"]

HEAD_CONFIG = "reward_head.json"
"""File name of the pooled-feature head's JSON description (format 2 of the module docstring)."""
HEAD_WEIGHTS = "reward_head.safetensors"
"""File name of the pooled-feature head's tensors ``mean``, ``std``, ``weight`` (each ``[D]``)."""
HEAD_FORMAT = "megatron_rlhf.pooled_linear_reward_head/v1"
POOLINGS = ("last", "reply_mean")


def scalar_head_problem(model_dir: str | Path) -> str | None:
    """Why ``model_dir`` is not a reward model, read from its ``config.json`` alone, or ``None``.

    Cheap (no transformers import, no weights read): used before any actor starts, so that a
    causal-LM folder given as a reward model is refused at once instead of after the policy is
    prepared. A folder with :data:`HEAD_CONFIG` (format 2) passes; otherwise the config must have
    one label (``num_labels: 1`` or a one-entry ``id2label``; transformers' default is 2).

    Returns:
        ``None`` when it looks like a reward model, else a sentence naming what was found
        (``architectures``, the label count).
    """
    d = Path(model_dir).expanduser()
    if (d / HEAD_CONFIG).is_file():
        return None
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"its config.json cannot be read ({e})"
    labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else cfg.get("num_labels", 2)
    if labels == 1:
        return None
    arch = ", ".join(cfg.get("architectures") or []) or "none given"
    kind = ", a causal language model" if arch.endswith("ForCausalLM") else ""
    return (f"its config.json has {labels} labels (architectures: {arch}{kind}) and there is no {HEAD_CONFIG}: a reward "
            "model needs a scalar head (num_labels: 1, e.g. LlamaForSequenceClassification) or the "
            "pooled head tools/train_reward_model.py writes")


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
    """Which features a pooled-feature reward head reads (the head is linear in them).

    Attributes:
        layers: trunk hidden states read on the sequence cut to ``max_length`` tokens, as indices of
            HF ``output_hidden_states``: ``0`` = token embeddings, ``l`` = the residual stream after
            ``l`` decoder layers, and the trunk's depth = its final normed output
            (``last_hidden_state``). Sorted, unique, each in ``[0, depth]``; may be empty when an
            embedding feature is on (then no transformer layer runs).
        poolings: subset of ``("last", "reply_mean")`` applied to each layer: the state at the
            last real token (the end-of-turn token), and the mean over the reply's tokens that
            survive truncation (the eos included).
        reply_embedding_mean: mean input-embedding vector of the whole (untruncated) reply, a
            bag-of-tokens view of the reply that truncation cannot cut.
        length_feature: ``log(1 + reply tokens)`` (untruncated, eos included). Reply length is a
            real signal of these labels (longer answers win most AlpacaEval/DOVE pairs, shorter ones
            most HH-harmless pairs); reports state the "longer reply wins" baseline next to it.
        length_x_prompt_embedding: ``log(1 + reply tokens)`` times the mean input embedding of the
            whole prompt, so the prompt decides whether a longer reply is better.
    """

    layers: tuple[int, ...]
    poolings: tuple[str, ...] = ("last",)
    reply_embedding_mean: bool = True
    length_feature: bool = True
    length_x_prompt_embedding: bool = True

    def __post_init__(self):
        if list(self.layers) != sorted(set(self.layers)) or (self.layers and min(self.layers) < 0):
            raise ValueError(f"feature layers {self.layers}: need a sorted, unique list of hidden-state "
                             "indices >= 0")
        if self.layers and (not self.poolings or any(p not in POOLINGS for p in self.poolings)
                            or len(set(self.poolings)) != len(self.poolings)):
            raise ValueError(f"poolings {self.poolings}: need a non-empty subset of {POOLINGS}")
        if not (self.layers or self.reply_embedding_mean or self.length_feature or self.length_x_prompt_embedding):
            raise ValueError("FeatureSpec: no feature selected (give layers or an embedding/length feature)")

    def dim(self, hidden_size: int) -> int:
        """Feature width ``D = (len(layers) * len(poolings) + reply_embedding_mean +
        length_x_prompt_embedding) * hidden_size + length_feature``."""
        blocks = len(self.layers) * len(self.poolings) + self.reply_embedding_mean + self.length_x_prompt_embedding
        return blocks * hidden_size + int(self.length_feature)

    def describe(self) -> str:
        """One readable line, e.g. ``hidden states 3, 6 (last) + reply embedding mean + log length +
        log length x prompt embedding``."""
        parts = ([f"hidden states {', '.join(map(str, self.layers))} ({', '.join(self.poolings)})"]
                 if self.layers else [])
        parts += [name for on, name in ((self.reply_embedding_mean, "reply embedding mean"),
                                        (self.length_feature, "log length"),
                                        (self.length_x_prompt_embedding, "log length x prompt embedding")) if on]
        return " + ".join(parts)

    def to_dict(self) -> dict:
        """JSON-able form (inverse of :meth:`from_dict`)."""
        return {"layers": list(self.layers), "poolings": list(self.poolings),
                "reply_embedding_mean": self.reply_embedding_mean, "length_feature": self.length_feature,
                "length_x_prompt_embedding": self.length_x_prompt_embedding}

    @classmethod
    def from_dict(cls, d: dict) -> FeatureSpec:
        """Build from :meth:`to_dict` output. Raises ValueError/KeyError on a malformed dict."""
        return cls(tuple(int(x) for x in d["layers"]), tuple(d["poolings"]), bool(d["reply_embedding_mean"]),
                   bool(d["length_feature"]), bool(d["length_x_prompt_embedding"]))


def reward_features(trunk, sequences: Sequence[Sequence[int]], reply_tokens: Sequence[int], spec: FeatureSpec,
                    max_length: int, pad_id: int):
    """Features of a batch of sequences, the input of a pooled-feature reward head.

    Args:
        trunk: an HF base model (``AutoModel``, e.g. ``LlamaModel``) of depth ``>= max(spec.layers)``
            accepting ``output_hidden_states=True``.
        sequences: ``B`` untruncated token-id lists ``prompt + reply`` (see :func:`encode_reward_parts`).
        reply_tokens: ``[B]`` reply lengths in tokens (completion + eos), each in ``[1, len(seq)]``.
        spec: which features (see :class:`FeatureSpec`).
        max_length: the trunk reads each sequence's last ``max_length`` tokens (the reply's end is
            kept); the embedding and length features use the whole sequence.
        pad_id: right-padding id (masked out; its value does not matter).
    Returns:
        ``[B, D]`` float32 (``D = spec.dim(hidden)``), in this order: per layer its poolings, the
        reply embedding mean, ``log(1 + reply tokens)`` times the prompt embedding mean, the length.
    Raises:
        ValueError: a layer index exceeds the trunk depth, or a reply length is out of range.
    Source: last-token pooling = HF ``*ForSequenceClassification``; linear probes on frozen
    representations, e.g. Alain & Bengio 2016; length as a preference signal: Singhal et al. 2023
    ("A Long Way to Go: Investigating Length Correlations in RLHF").
    """
    import torch

    depth = trunk.config.num_hidden_layers
    if spec.layers and max(spec.layers) > depth:
        raise ValueError(f"feature layers {spec.layers}: the trunk has only {depth} layers")
    if len(sequences) != len(reply_tokens) or any(not 1 <= r <= len(s) for s, r in zip(sequences, reply_tokens)):
        raise ValueError("reply_tokens: one per sequence, each between 1 (the eos) and the sequence length")
    emb = trunk.get_input_embeddings()
    dev = emb.weight.device
    feats = []
    if spec.layers:
        cut = [list(s)[-max_length:] for s in sequences]
        ids, mask = pad_right(cut, pad_id)
        ids, mask = ids.to(dev), mask.to(dev)
        out = trunk(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        n = mask.sum(-1)  # [B]
        rows = torch.arange(ids.shape[0], device=dev)
        pos = torch.arange(ids.shape[1], device=dev)
        start = (n - torch.tensor(list(reply_tokens), device=dev)).clamp_min(0)
        reply = ((pos[None, :] >= start[:, None]) & (pos[None, :] < n[:, None])).to(out.last_hidden_state.dtype)
        for layer in spec.layers:
            h = out.last_hidden_state if layer == depth else out.hidden_states[layer]
            for p in spec.poolings:
                if p == "last":
                    feats.append(h[rows, n - 1].float())
                else:
                    feats.append(((h * reply[..., None]).sum(1) / reply.sum(1, keepdim=True)).float())
    log_len = torch.log1p(torch.tensor([float(r) for r in reply_tokens], device=dev))[:, None]  # [B, 1]
    if spec.reply_embedding_mean:
        feats.append(torch.stack([emb(torch.tensor(list(s)[len(s) - r:], device=dev)).float().mean(0)
                                  for s, r in zip(sequences, reply_tokens)]))
    if spec.length_x_prompt_embedding:
        h = emb.weight.shape[1]
        pm = [emb(torch.tensor(list(s)[:len(s) - r], device=dev)).float().mean(0) if len(s) > r
              else torch.zeros(h, device=dev) for s, r in zip(sequences, reply_tokens)]
        feats.append(log_len * torch.stack(pm))
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
            reply_lengths: per sequence, how many trailing tokens are the reply (completion + eos).
                Required by pooled-feature heads; ignored by sequence-classification models.
        Returns:
            ``len(sequences)`` floats in input order. Sequences are sorted by length, right-padded,
            run in batches of ``batch_size``; the trunk reads each one's last ``max_length`` tokens
            (cut ones are counted in ``num_truncated``).
        Raises:
            ValueError: an empty sequence, or ``reply_lengths`` missing/mismatched for a pooled head.
        """
        if self.head_spec is not None and (reply_lengths is None or len(reply_lengths) != len(sequences)):
            raise ValueError("score_token_ids: this pooled reward head reads the reply; pass reply_lengths "
                             "(one per sequence: completion tokens + 1 for the eos), or use score()")
        fn = self._pooled_rewards if self.head_spec is not None else self._seqcls_rewards
        r = self._batched(sequences, reply_lengths, fn)
        self.num_scored += len(sequences)
        return [float(x) for x in r]

    def features(self, prompts: Sequence, completions: Sequence[str]):
        """Pooled-head input features of (prompt, completion) pairs, exactly as scored.

        Args:
            prompts, completions: as in :meth:`score`.
        Returns:
            ``[N, D]`` float32 tensor (:func:`reward_features`).
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
                             lambda seqs, reps: reward_features(self.trunk, seqs, reps, self.head_spec,
                                                                self.max_length, self.pad_id))

    def _pooled_rewards(self, seqs, reps):
        """``[B]`` rewards of untruncated sequences under the pooled-feature head."""
        f = reward_features(self.trunk, seqs, reps, self.head_spec, self.max_length, self.pad_id)
        return f @ self._head_w + self._head_b

    def _seqcls_rewards(self, seqs, reps):
        """``[B]`` rewards of the sequence-classification model on the sequences' last ``max_length`` tokens."""
        ids, mask = pad_right([list(s)[-self.max_length:] for s in seqs], self.pad_id)
        return self.rewards(ids.to(self.device), mask.to(self.device))

    def _batched(self, sequences, reply_lengths, fn):
        """Sort by length, run ``fn(seqs, reply_lengths)`` per batch of ``batch_size`` without gradients;
        returns the row outputs stacked ``[N, ...]`` in input order (CPU). Counts truncations."""
        import torch

        seqs = [list(s) for s in sequences]
        if any(not s for s in seqs):
            raise ValueError("score_token_ids: empty sequence")
        if not seqs:
            return torch.zeros(0)
        self.num_truncated += sum(len(s) > self.max_length for s in seqs)
        reps = list(reply_lengths) if reply_lengths is not None else [1] * len(seqs)
        out: list = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: min(len(seqs[i]), self.max_length))
        with torch.no_grad():
            for b in range(0, len(order), self.batch_size):
                idx = order[b:b + self.batch_size]
                r = fn([seqs[i] for i in idx], [reps[i] for i in idx])
                for j, i in enumerate(idx):
                    out[i] = r[j].float().cpu()
        return torch.stack(out)

    def rewards(self, input_ids, attention_mask):
        """Rewards of a right-padded batch (sequence-classification format only; pooled heads score
        through :meth:`score` / :meth:`score_token_ids`, which need the untruncated reply).

        Args:
            input_ids: ``[B, S]`` int64, right-padded.
            attention_mask: ``[B, S]`` 1 on real tokens (a prefix of each row), 0 on padding.
        Returns:
            ``[B]`` float32: ``score(h[b, last_b])`` with ``h`` the trunk's final (normed) hidden
            states ``[B, S, H]`` and ``last_b = attention_mask[b].sum() - 1``. Equals the HF
            ``AutoModelForSequenceClassification`` logits when the pad id never occurs in the rows.
        Raises:
            ValueError: called on a pooled-feature head.
        """
        import torch

        if self.head_spec is not None:
            raise ValueError("rewards: a pooled-feature head scores token lists; use score_token_ids(seqs, reply_lengths)")
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
    variance; Welford 1962), so the result does not depend on how rewards were batched. Every
    finite reward is accepted, however large (1e300): the statistics are kept as (count, mean,
    std) and computed on values scaled by their largest magnitude, so nothing squares a huge
    number (no ``OverflowError``, no inf).

    Args:
        eps: added to the std in :meth:`normalize` (reward units).
    """

    def __init__(self, eps: float = 1e-6):
        if not eps > 0:
            raise ValueError(f"eps={eps}: must be > 0")
        self.eps = eps
        self._stats: dict[str, tuple[int, float, float]] = {}  # task -> (count, mean, std)

    def update(self, task: str, rewards: Sequence[float]) -> None:
        """Fold a batch of finite rewards of ``task`` into its statistics (non-finite ones are ignored)."""
        xs = [float(r) for r in rewards if math.isfinite(r)]
        if not xs:
            return
        nb = len(xs)
        c = max(abs(x) for x in xs) or 1.0
        ys = [x / c for x in xs]                 # in [-1, 1]
        mb = sum(ys) / nb
        sb = math.sqrt(sum((y - mb) * (y - mb) for y in ys) / nb)
        self._stats[task] = _merge_moments(self._stats.get(task), (nb, mb * c, sb * c))

    def stats(self, task: str) -> tuple[int, float, float]:
        """``(count, mean, std)`` of ``task`` (population std; ``(0, 0.0, 1.0)`` before any update)."""
        return self._stats.get(task, (0, 0.0, 1.0))

    def normalize(self, task: str, rewards: Sequence[float]) -> list[float]:
        """``(r - mean) / (std + eps)`` with the task's current statistics (call :meth:`update` first).

        Finite for every finite input (halved before subtracting, so two huge rewards of opposite
        sign cannot overflow; a quotient beyond the float range is clamped to it).

        Raises:
            KeyError: no reward of ``task`` was seen yet.
        """
        if task not in self._stats:
            raise KeyError(f"RunningRewardNormalizer: no rewards of task {task!r} seen yet; call update() first")
        _, m, s = self.stats(task)
        half_den = (s + self.eps) / 2
        big = sys.float_info.max
        return [max(-big, min(big, (float(r) / 2 - m / 2) / half_den)) for r in rewards]

    def state_dict(self) -> dict:
        """Checkpointable state: ``{"eps", "moments": {task: [count, mean, std]}}`` (plain ints and
        floats: survives ``json.dumps``/``json.loads`` exactly, Python floats round-trip in JSON)."""
        return {"eps": self.eps,
                "moments": {k: [int(v[0]), float(v[1]), float(v[2])] for k, v in self._stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (e.g. after a JSON round trip); the older form
        ``{"eps", "stats": {task: [count, mean, M2]}}`` is read too.

        Raises:
            ValueError: malformed state (missing keys, an entry that is not ``[count >= 0, mean,
                std or M2 >= 0]`` of finite numbers); nothing is changed then.
        """
        try:
            eps = float(state["eps"])
            if "moments" in state:
                stats = {str(k): (int(v[0]), float(v[1]), float(v[2])) for k, v in state["moments"].items()}
            else:
                stats = {str(k): (int(v[0]), float(v[1]), float(v[2])) for k, v in state["stats"].items()}
                stats = {k: (n, m, math.sqrt(m2 / n) if n and m2 >= 0 else m2)
                         for k, (n, m, m2) in stats.items()}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"RunningRewardNormalizer.load_state_dict: expected {{'eps', 'moments': {{task: "
                             f"[count, mean, std]}}}}, got {state!r:.200} ({e})") from e
        bad = [k for k, (n, m, s) in stats.items() if n < 0 or s < 0 or not (math.isfinite(m) and math.isfinite(s))]
        if not eps > 0 or bad:
            raise ValueError(f"RunningRewardNormalizer.load_state_dict: eps={eps} (must be > 0), bad stats for {bad}")
        self.eps, self._stats = eps, stats


def _merge_moments(a: tuple[int, float, float] | None, b: tuple[int, float, float]) -> tuple[int, float, float]:
    """``(count, mean, std)`` of the union of two samples given by theirs (Chan et al. 1979:
    ``var = w_a var_a + w_b var_b + w_a w_b (mean_a - mean_b)^2``), computed on values scaled by
    the largest magnitude involved so that nothing overflows."""
    if a is None or a[0] == 0:
        return b
    (na, ma, sa), (nb, mb, sb) = a, b
    n = na + nb
    wa, wb = na / n, nb / n
    c = max(abs(ma), abs(mb), sa, sb) or 1.0
    d = ma / c - mb / c
    var = wa * (sa / c) ** 2 + wb * (sb / c) ** 2 + wa * wb * d * d
    return n, ma * wa + mb * wb, c * math.sqrt(var)


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
