"""Reward-model scoring of chat completions: a causal-LM trunk with a scalar head.

A reward model here is a Hugging Face *sequence-classification* folder with ``num_labels=1``
(``AutoModelForSequenceClassification``: e.g. ``LlamaForSequenceClassification`` = the Llama trunk +
a bias-free ``score`` linear layer ``[hidden] -> [1]``), such as the one
``tools/train_reward_model.py`` writes. The reward of (prompt, completion) is the head applied to
the trunk's final hidden state at the last real token of

    chat_template(prompt, add_generation_prompt=True) + completion.strip() + <eos>

(:meth:`RewardModel.encode`, used identically by the training tool), i.e. the Bradley-Terry reward
of Ouyang et al. 2022 (eq. 1) read at the end-of-turn token. :class:`RewardModel` is a plain class;
the trainer wraps it as a Ray actor (``ray.remote(num_cpus=1)(RewardModel)``).

Also here: :class:`RunningRewardNormalizer` (per-task running mean/std, so that reward-model
scores of different tasks are on a common scale before pairing, issue 7) and
:func:`length_normalized_rewards` (for logging/checkpoint selection).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RewardModel", "RunningRewardNormalizer", "length_normalized_rewards", "bradley_terry_loss"]


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


class RewardModel:
    """Batched scalar rewards from an HF sequence-classification model (``num_labels=1``).

    Args:
        model_dir: HF folder (config with ``num_labels == 1``, weights, tokenizer with chat template).
        dtype: ``float32`` (CPU) or ``bfloat16``.
        device: torch device string (``cpu`` or ``cuda``).
        batch_size: sequences per forward pass.
        max_length: sequences longer than this are cut from the left (the completion's end and
            the end-of-turn token, where the reward is read, are kept); counted in
            ``self.num_truncated``.
    Raises:
        ValueError: the folder is missing, the model has ``num_labels != 1``, or it has no
            ``score`` head / chat template.
    """

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 batch_size: int = 8, max_length: int = 1024):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        d = Path(model_dir).expanduser()
        if not (d / "config.json").is_file():
            raise ValueError(f"reward_model={str(model_dir)!r}: no config.json there; give a folder "
                             "written by tools/train_reward_model.py or an HF sequence-classification model")
        cfg = AutoConfig.from_pretrained(d)
        if getattr(cfg, "num_labels", None) != 1:
            raise ValueError(f"reward_model={str(model_dir)!r}: num_labels={cfg.num_labels}, expected 1 "
                             "(a scalar reward head)")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={dtype!r}: expected float32 or bfloat16")
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size={batch_size}, max_length={max_length}: need >= 1 and >= 2")
        self.tokenizer = AutoTokenizer.from_pretrained(d)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward_model={str(model_dir)!r}: the tokenizer has no chat template")
        self.model = AutoModelForSequenceClassification.from_pretrained(
            d, dtype=getattr(torch, dtype)).to(device).eval()
        if not hasattr(self.model, "score"):
            raise ValueError(f"reward_model={str(model_dir)!r}: {type(self.model).__name__} has no "
                             "'score' head; use a Llama/Qwen/Mistral-style sequence-classification model")
        self.trunk = getattr(self.model, self.model.base_model_prefix)
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.eos_id = self.tokenizer.eos_token_id
        self.num_truncated = 0
        self.num_scored = 0

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
        return self.score_token_ids([self.encode(p, c) for p, c in zip(prompts, completions)])

    def encode(self, prompt, completion: str) -> list[int]:
        """Token ids the reward is read from: ``template(prompt) + completion.strip() + [eos]``.

        Returns:
            ``[seq_len]`` ids (not yet truncated). The training tool uses this same function.
        Raises:
            ValueError: unsupported ``prompt`` type.
        """
        tok = self.tokenizer
        return encode_for_reward(tok, prompt, completion)

    def score_token_ids(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """Rewards of already-encoded sequences (see :meth:`encode`).

        Sequences are sorted by length, right-padded, run in batches of ``batch_size``
        (``attention_mask`` marks real tokens) and scored at each row's last real token.
        Returns ``len(sequences)`` floats in input order.
        """
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
        out = [0.0] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        with torch.no_grad():
            for b in range(0, len(order), self.batch_size):
                idx = order[b:b + self.batch_size]
                ids, mask = pad_right([seqs[i] for i in idx], self.pad_id)
                r = self.rewards(ids.to(self.device), mask.to(self.device))
                for j, i in enumerate(idx):
                    out[i] = float(r[j])
        self.num_scored += len(seqs)
        return out

    def rewards(self, input_ids, attention_mask):
        """Rewards of a right-padded batch.

        Args:
            input_ids: ``[B, S]`` int64, right-padded.
            attention_mask: ``[B, S]`` 1 on real tokens (a prefix of each row), 0 on padding.
        Returns:
            ``[B]`` float32: ``score(h[b, last_b])`` with ``h`` the trunk's final (normed) hidden
            states ``[B, S, H]`` and ``last_b = attention_mask[b].sum() - 1``. Equals the HF
            ``AutoModelForSequenceClassification`` logits when the pad id never occurs in the rows.
        """
        import torch

        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.long().sum(-1) - 1
        pooled = h[torch.arange(h.shape[0], device=h.device), last]
        return self.model.score(pooled).squeeze(-1).float()

    @property
    def pad_id(self) -> int:
        """Padding id for batches (never read: pooling uses the attention mask)."""
        p = self.model.config.pad_token_id
        return int(p if p is not None else (self.eos_id or 0))


def encode_for_reward(tokenizer, prompt, completion: str) -> list[int]:
    """``chat_template(prompt, add_generation_prompt=True) + completion.strip() + [eos]`` as ids.

    Args:
        tokenizer: HF tokenizer with a chat template and an ``eos_token_id`` (end of turn).
        prompt: chat messages, a user string, or prompt token ids (template already applied).
        completion: reply text.
    Returns:
        ``[seq_len]`` token ids.
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
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        p_ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"prompt of type {type(prompt).__name__}: expected chat messages "
                         "(list of {'role','content'} dicts), a string, or token ids")
    c_ids = list(tokenizer(completion.strip(), add_special_tokens=False)["input_ids"])
    return p_ids + c_ids + [int(tokenizer.eos_token_id)]


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
