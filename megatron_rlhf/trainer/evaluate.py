"""Evaluation of the policy on held-out prompts of every task (config section ``eval:``).

What is scored, per task (``Evaluator.evaluate``; one weight version per eval):

* every task: the greedy completion (temperature 0, one per prompt) of each held-out prompt;
  ``eval/<task>/len_mean_tokens`` is its length;
* math tasks (``math_verify``): ``eval/<task>/pass@1`` = share of prompts whose greedy completion
  is correct, and ``eval/<task>/mean@k`` = mean over prompts of the share of ``eval.samples`` (k)
  sampled completions (``eval.temperature``, default ``generators.temperature``) that are correct;
* math tasks with ``eval.pass_at_k`` (e.g. ``[1, 4, 8]``): ``eval/<task>/pass@<k>_unbiased`` =
  mean over prompts of Chen et al.'s unbiased estimate of pass@k from the same n = ``eval.samples``
  sampled completions (:func:`pass_at_k`; a completion is correct when its reward is > 0.5:
  math-verify scores 1 or 0); nothing extra is generated;
* reward-model and plug-in tasks: ``eval/<task>/reward_mean`` = mean reward of the greedy
  completions;
* each value with ``.../se``: the standard error over prompts (sample standard deviation of the
  per-prompt values / sqrt(number of prompts)); plus ``eval/<task>/num_prompts``, ``eval/step``
  (the steps trained before the eval), ``eval/weight_version`` and ``time/eval_s``;
* per prompt, in eval order (:func:`heldout_order`): ``eval/<task>/outcomes`` (math: a string of
  ``0``/``1``, one character per prompt: is its greedy completion correct; other tasks: the list of
  greedy rewards, 4 decimals) and ``eval/<task>/ids`` (each prompt's row number in its file), so two
  evals of the same prompts can be compared paired (McNemar);
* with ``eval.kl_ref`` (default on) and ``eval.samples`` > 0, the KL of the evaluated policy to
  the reference on fresh samples: every task's prompts get ``eval.samples`` sampled completions
  (math: the mean@k ones; other tasks: sampled for this alone, not scored), all from the evaluated
  weight version (checked), and the learner scores them with its reference (one forward-only pass,
  ``MegatronLearner.reference_logprobs``, at the eval's sampling temperature). The policy side is
  the generator's own sampling logprobs of those tokens: they are the evaluated version's (the
  eval refuses completions of any other version), and the learner may already hold newer weights
  (async), so it cannot recompute them. :func:`kl_ref_metrics` gives ``eval/<task>/kl_ref`` (mean
  k3 per completion token, nats/token, with ``/se`` clustered by prompt), ``kl_ref_k1`` and
  ``kl_ref_seq`` (k3 summed per completion, nats/completion, ``/se`` over prompts), plus
  ``eval/reference_version`` and ``time/eval_kl_ref_s``. k3 (``exp(d) - d - 1``, ``d = log pi_ref -
  log pi``) because it is unbiased for samples of pi and >= 0 on every token, so its mean is >= 0
  and a small numerical gap between the generator's and the learner's kernels adds only
  ``d^2 / 2`` (k1's mean moves by the gap itself and goes negative on a finite sample); k1 is kept
  beside it. It is the KL of the distribution sampled (``softmax(logits / temperature)``): with
  ``generators.top_p < 1`` that is the truncated one, and ``kl_ref`` is > 0 even before any update.
  On the producer's thread the eval only submits the reference pass; the row waits for
  it (:class:`EvalService`), so generation goes on meanwhile. Without samples or without a
  reference (``tools/evaluate.py`` loads none) the row has no ``kl_ref`` and
  ``eval/kl_ref_skipped`` says why;
* reward-model tasks, judged against the starting policy: ``eval/<task>/proxy_win_rate`` = share
  of prompts whose greedy reply the task's own (training) reward model scores above the reply of
  the policy at the eval before step 1 (:func:`win_rate_metrics`; ties count half; 0.5 at that
  first eval by construction); with ``tasks[].eval_reward`` (a reward model training never
  optimised against, the "gold" one) also ``eval/<task>/gold_reward_mean``, ``.../gold_outcomes``
  and ``eval/<task>/win_rate``, the same share judged by it. The starting replies' scores are the
  first eval's per-prompt outcomes (kept in its row, so a resumed run reads them back:
  :meth:`Evaluator.set_base`); scores compare at the 4 decimals the rows store. A proxy win rate
  that climbs while the gold one does not is over-optimisation of the proxy (Gao et al. 2023);
* when the prompts carry a cluster id (``Prompt.group``: the arithmetic rows' ``product``, the same
  for every wording and both orders of a x b): ``eval/<task>/groups`` (per prompt, eval order),
  ``eval/<task>/num_clusters`` and each value's ``.../se_cluster``, the cluster-robust standard
  error (:func:`cluster_se`; prompts of one product are not independent draws).

The held-out prompts (:func:`split_eval_prompts`): the task's ``eval_data`` file when given, else
a fixed slice of its training data (the prompts first in sha256 order of their text); at most
``eval.num_prompts``; training never draws a prompt whose text is an eval prompt's.

In the trainer the eval runs on the generator pool's own thread (the rollout producer, which owns
the pool): the loop hands a published weight version to :class:`EvalService` *before* it
publishes it for generation, and the producer serves pending evals at the top of each batch and
right after its weight handshake, so the pool holds exactly that version (never a newer one)
while evaluating. (With ``async.max_staleness >= 2`` the producer may run a batch ahead of the
learner and its engines may already hold a newer version when the request arrives; the eval then
scores that version and records it: ``eval/weight_version`` is always the version scored.) ``tools/evaluate.py`` runs the same :class:`Evaluator` on a pool of a fresh
vLLM engine of any HF folder.

Sources: a proxy reward model for training and a gold one for evaluation, with win rates against a
fixed baseline's replies, as in Noukhovitch et al. 2024 (sec. 3, "gold" reward model) after Gao et al.
2023 ("Scaling Laws for Reward Model Overoptimization"); KL estimators k1 and k3 of Schulman 2020 ("Approximating KL divergence"); KL to the
reference on samples of the evaluated policy as the x-axis of Noukhovitch et al. 2024's
reward-KL frontier (Fig. 3-4). pass@k and the mean of k samples as in Chen et al. 2021 ("Evaluating Large Language
Models Trained on Code", sec. 2.1, k = 1 greedy); standard error of a mean over prompts as in
Miller 2024 ("Adding Error Bars to Evals", eq. 1), clustered as in its clustered standard
errors with the CR1 small-sample factor G / (G - 1) of Cameron and Miller 2015 ("A Practitioner's Guide to
Cluster-Robust Inference", sec. II.C).
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

from megatron_rlhf.types import Prompt

__all__ = ["mean_se", "cluster_se", "pass_at_k", "heldout_order", "split_eval_prompts", "Evaluator", "EvalService",
           "EvalFuture", "PendingRows", "eval_due", "eval_keys_of", "eval_metrics", "format_eval_line", "kl_ref_metrics", "win_rate_metrics",
           "KL_REF_SKIPPED"]

KL_REF_SKIPPED = "eval/kl_ref_skipped"
"""Row key (a string) saying why an eval with ``eval.kl_ref`` on has no ``eval/<task>/kl_ref``."""


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean of ``values`` (one value per prompt).

    ``se = s / sqrt(n)`` with ``s`` the sample standard deviation (``n - 1`` in the denominator);
    ``se = 0`` for a single value; ``(nan, nan)`` for none; ``inf`` when the squares overflow
    (rewards of 1e300: logged as null, never an error).
    Source: Miller 2024, "Adding Error Bars to Evals", eq. 1.
    """
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(values) / n
    if n == 1:
        return m, 0.0
    var = sum((v - m) * (v - m) for v in values) / (n - 1)   # huge values give inf, never OverflowError
    return m, math.sqrt(var / n)


def cluster_se(values: list[float], groups: list) -> float:
    """Cluster-robust standard error of the mean of ``values`` with clusters ``groups``.

    ``se^2 = G / (G - 1) * sum_g (sum_{i in g} (v_i - mean))^2 / n^2`` for ``n`` values in ``G``
    clusters (CR1; Cameron and Miller 2015, sec. II.C; Miller 2024, clustered standard errors).
    With every value its own cluster it equals :func:`mean_se`'s ``s / sqrt(n)``; values that move together within a
    cluster make it larger. ``nan`` for no value or a single cluster (``G < 2``: the spread
    between clusters is unknown).

    Args:
        values: ``[n]`` one value per prompt (0/1 for pass@1).
        groups: ``[n]`` the cluster id of each (hashable; e.g. the unordered product ``"6 x 8"``).
    Raises:
        ValueError: ``values`` and ``groups`` differ in length.
    """
    n = len(values)
    if len(groups) != n:
        raise ValueError(f"cluster_se: {n} values but {len(groups)} cluster ids")
    if n == 0:
        return float("nan")
    m = sum(values) / n
    totals: dict = {}
    for v, g in zip(values, groups):
        totals[g] = totals.get(g, 0.0) + (v - m)
    num_g = len(totals)
    if num_g < 2:
        return float("nan")
    return math.sqrt(num_g / (num_g - 1) * sum(t * t for t in totals.values())) / n


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct:
    ``1 - C(n - c, k) / C(n, k)``.

    Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"), eq. 1, computed in their
    numerically stable form ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials);
    1.0 when ``n - c < k`` (every draw of k holds a correct one). ``k = 1`` gives ``c / n``.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k} "
                         "(eval.pass_at_k needs k <= eval.samples)")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _text_key(p: Prompt) -> str:
    return hashlib.sha256(f"{p.text}\x1f{p.answer}".encode()).hexdigest()


def heldout_order(prompts: list[Prompt]) -> list[Prompt]:
    """``prompts`` sorted by sha256 of (text, answer): a fixed order that depends on neither the
    run seed nor the file order, so the held-out slice is the same in every run of a task."""
    return sorted(prompts, key=lambda p: (_text_key(p), p.index))


def split_eval_prompts(tasks: list, train_by_task: dict[str, list[Prompt]], eval_cfg,
                       load_eval: Callable[[object], list[Prompt]]) -> tuple[dict, dict, dict]:
    """Held-out prompts of every task, and the training prompts with them taken out.

    Args:
        tasks: ``cfg.tasks`` (``TaskConfig``: ``name``, ``eval_data``).
        train_by_task: task name -> all its training prompts (from ``tasks[].data``).
        eval_cfg: ``EvalConfig`` (``num_prompts``, ``holdout_frac``).
        load_eval: ``task_cfg -> prompts`` of the task's ``eval_data`` file (called only for tasks
            that have one; the caller loads it like ``data``).
    Returns:
        ``(train_by_task, eval_by_task, counts)``: training prompts without any prompt whose
        (text, answer) equals an eval prompt's; per task the first ``eval.num_prompts`` eval
        prompts in :func:`heldout_order` (from ``eval_data``, or else at most
        ``floor(holdout_frac x len)`` of the training prompts; none when that is 0: such a tiny
        task is trained on all its prompts and not evaluated); counts per task
        ``{"eval_prompts", "eval_source", "train_removed"}``.
    Raises:
        ValueError: no training prompt is left (names ``tasks[NAME].eval_data``).
    """
    train_out, eval_out, counts = {}, {}, {}
    for task in tasks:
        train = train_by_task[task.name]
        if task.eval_data is not None:
            pool, source = heldout_order(load_eval(task)), "eval_data"
            num = eval_cfg.num_prompts
        else:
            pool, source = heldout_order(train), "holdout"
            num = min(eval_cfg.num_prompts, int(len(train) * eval_cfg.holdout_frac))
            if num < 1:   # too small to spare any: trained in full, not evaluated (counted)
                train_out[task.name], eval_out[task.name] = train, []
                counts[task.name] = {"eval_prompts": 0, "eval_source": "none (too few prompts for a held-out "
                                     f"slice at eval.holdout_frac={eval_cfg.holdout_frac})", "train_removed": 0}
                continue
        heldout = pool[:num]
        keys = {_text_key(p) for p in heldout}
        kept = [p for p in train if _text_key(p) not in keys]
        if not kept:
            raise ValueError(f"task {task.name!r}: every training prompt is also an eval prompt; give "
                             f"tasks[{task.name}].eval_data another file or set eval.enabled=false")
        train_out[task.name], eval_out[task.name] = kept, heldout
        counts[task.name] = {"eval_prompts": len(heldout), "eval_source": source,
                             "train_removed": len(train) - len(kept)}
    return train_out, eval_out, counts


def eval_metrics(task: str, kind: str, greedy_rewards: list[float], greedy_lens: list[int],
                 sampled_rewards: list[list[float]] | None, pass_ks: list[int] | tuple = (), *,
                 ids: list[int] | None = None, groups: list[str] | None = None) -> dict:
    """The ``eval/<task>/...`` values of one task from per-prompt results.

    Args:
        task: task name.
        kind: ``math_verify``, ``reward_model`` or ``plugin`` (``TaskConfig.kind``).
        greedy_rewards: ``[P]`` reward of each prompt's greedy completion (0/1 for math).
        greedy_lens: ``[P]`` its length in tokens.
        sampled_rewards: ``[P][k]`` rewards of k sampled completions (math only; None: not sampled).
        pass_ks: the k of ``eval.pass_at_k`` (each <= the samples per prompt).
        ids: ``[P]`` each prompt's id (``Prompt.index``; None: not recorded).
        groups: ``[P]`` each prompt's cluster id (``Prompt.group``; None or all ``""``: no clusters).
    Returns:
        math: ``pass@1``, ``mean@k`` (when sampled), ``pass@<k>_unbiased`` for each of
        ``pass_ks`` (when sampled; :func:`pass_at_k` per prompt, correct = reward > 0.5), their
        ``/se``; others ``reward_mean`` and
        ``/se``; every task ``len_mean_tokens`` and ``/se``, ``num_prompts``, ``outcomes`` (math:
        ``"0110..."``, greedy correct = reward > 0.5; others: greedy rewards rounded to 4 places),
        ``ids`` when given; with clusters ``groups``, ``num_clusters`` and every value's
        ``/se_cluster`` (:func:`cluster_se`); keys prefixed ``eval/<task>/``.
    Raises:
        ValueError: ``ids`` or ``groups`` not one per prompt.
    """
    pre = f"eval/{task}/"
    out: dict = {pre + "num_prompts": len(greedy_rewards)}
    for name, xs in (("ids", ids), ("groups", groups)):
        if xs is not None and len(xs) != len(greedy_rewards):
            raise ValueError(f"eval_metrics({task!r}): {len(xs)} {name} for {len(greedy_rewards)} prompts")
    clusters = list(groups) if groups is not None and any(groups) else None

    def put(name, values):
        vals = [float(v) for v in values]
        out[pre + name], out[pre + name + "/se"] = mean_se(vals)
        if clusters is not None:
            out[pre + name + "/se_cluster"] = cluster_se(vals, clusters)

    if kind == "math_verify":
        put("pass@1", greedy_rewards)
        if sampled_rewards is not None:
            put("mean@k", [sum(r) / len(r) for r in sampled_rewards])
            for k in pass_ks:
                put(f"pass@{k}_unbiased", [pass_at_k(len(r), sum(1 for v in r if v > 0.5), k)
                                           for r in sampled_rewards])
    else:
        put("reward_mean", greedy_rewards)
    put("len_mean_tokens", greedy_lens)
    out[pre + "outcomes"] = ("".join("1" if float(r) > 0.5 else "0" for r in greedy_rewards)
                             if kind == "math_verify" else [round(float(r), 4) for r in greedy_rewards])
    if ids is not None:
        out[pre + "ids"] = [int(i) for i in ids]
    if clusters is not None:
        out[pre + "groups"] = clusters
        out[pre + "num_clusters"] = len(set(clusters))
    return out


def kl_ref_metrics(task: str, policy_logprobs: list, ref_logprobs: list, prompt_ids: list) -> dict:
    """KL(policy || reference) of one task from its eval's sampled completions (module docstring).

    Args:
        task: task name.
        policy_logprobs: ``[C][L_c]`` the sampling logprob of each token of completion c under the
            evaluated policy (``Completion.logprobs``, nats, after temperature).
        ref_logprobs: ``[C][L_c]`` the same tokens' logprobs under the reference, at the same
            temperature. Tokens whose policy or reference logprob is not finite are left out.
        prompt_ids: ``[C]`` the prompt each completion samples (its cluster).
    Returns:
        ``eval/<task>/kl_ref``: mean per-token k3 = ``exp(d) - d - 1``, ``d = ref - policy``, over
        every kept token (nats/token; >= 0); ``kl_ref/se``: its standard error clustered by prompt
        (:func:`cluster_se` of the per-token values: a ratio estimator's delta-method se);
        ``kl_ref_k1``: the mean of ``policy - ref`` (unbiased, either sign); ``kl_ref_seq`` and
        ``/se``: k3 summed over each completion, averaged per prompt, mean and se over prompts
        (nats/completion); ``kl_ref_tokens``. Empty when no token is kept.
    Raises:
        ValueError: the three lists differ in length, or a completion's two logprob lists do.
    Source: Schulman 2020, "Approximating KL divergence" (k1, k3), via
    :func:`megatron_rlhf.losses._common.kl_estimate`.
    """
    import torch

    from megatron_rlhf.losses._common import kl_estimate

    if not len(policy_logprobs) == len(ref_logprobs) == len(prompt_ids):
        raise ValueError(f"kl_ref_metrics({task!r}): {len(policy_logprobs)} policy, {len(ref_logprobs)} "
                         f"reference and {len(prompt_ids)} prompt entries")
    if any(len(a) != len(b) for a, b in zip(policy_logprobs, ref_logprobs)):
        raise ValueError(f"kl_ref_metrics({task!r}): a completion has policy and reference logprobs "
                         "of different lengths")
    width = max((len(a) for a in policy_logprobs), default=0)
    if width == 0:
        return {}
    pol = torch.zeros(len(policy_logprobs), width, dtype=torch.float64)
    ref = torch.zeros_like(pol)
    for i, (a, b) in enumerate(zip(policy_logprobs, ref_logprobs)):
        pol[i, :len(a)] = torch.tensor(a, dtype=torch.float64)
        ref[i, :len(b)] = torch.tensor(b, dtype=torch.float64)
    lengths = torch.tensor([len(a) for a in policy_logprobs])
    mask = ((torch.arange(width)[None, :] < lengths[:, None]) & torch.isfinite(pol)
            & torch.isfinite(ref)).double()
    pol, ref = torch.where(mask > 0, pol, 0.0), torch.where(mask > 0, ref, 0.0)
    k3, k1 = kl_estimate(pol, ref, mask, "k3"), kl_estimate(pol, ref, mask, "k1")
    on = mask > 0
    if not bool(on.any()):
        return {}
    tok_k3 = k3[on].tolist()
    tok_groups = [prompt_ids[i] for i in on.nonzero()[:, 0].tolist()]
    per_seq = (k3 * mask).sum(-1).tolist()
    by_prompt: dict = {}
    for pid, v in zip(prompt_ids, per_seq):
        by_prompt.setdefault(pid, []).append(v)
    pre = f"eval/{task}/"
    out = {pre + "kl_ref": sum(tok_k3) / len(tok_k3), pre + "kl_ref/se": cluster_se(tok_k3, tok_groups),
           pre + "kl_ref_k1": float(k1[on].mean()), pre + "kl_ref_tokens": len(tok_k3)}
    out[pre + "kl_ref_seq"], out[pre + "kl_ref_seq/se"] = mean_se([sum(v) / len(v) for v in by_prompt.values()])
    return out


def win_rate_metrics(task: str, name: str, ids: list[int], scores: list[float], base: dict[int, float]) -> dict:
    """The share of prompts whose reply scores above the baseline reply to the same prompt.

    Per prompt the outcome is 1 (``score > base``), 0.5 (equal) or 0; the mean over the prompts
    that have a baseline score, with its standard error over prompts (:func:`mean_se`). Scores are
    compared as given (the evaluator rounds both sides to the 4 decimals the rows store, so a
    resumed run compares as the first session would).

    Args:
        task: task name.
        name: the key, e.g. ``win_rate`` (gold judge) or ``proxy_win_rate`` (training reward model).
        ids: ``[P]`` each prompt's id (``Prompt.index``).
        scores: ``[P]`` the judge's score of each prompt's reply now.
        base: prompt id -> the same judge's score of the baseline's reply.
    Returns:
        ``eval/<task>/<name>``, ``.../se`` and ``eval/<task>/<name>_prompts`` (prompts compared);
        empty when no prompt has a baseline score.
    Raises:
        ValueError: ``ids`` and ``scores`` differ in length.
    Source: win rate against a fixed baseline's replies as Noukhovitch et al. 2024 report it (there
    judged by a gold model against reference summaries; here against the starting policy).
    """
    if len(ids) != len(scores):
        raise ValueError(f"win_rate_metrics({task!r}): {len(ids)} prompt ids for {len(scores)} scores")
    outcomes = [1.0 if s > base[i] else 0.5 if s == base[i] else 0.0 for i, s in zip(ids, scores) if i in base]
    if not outcomes:
        return {}
    pre = f"eval/{task}/{name}"
    out = {pre + "_prompts": len(outcomes)}
    out[pre], out[pre + "/se"] = mean_se(outcomes)
    return out


def eval_keys_of(row: dict) -> list[str]:
    """The ``eval/...`` keys of a metrics row, in row order."""
    return [k for k in row if k.startswith("eval/")]


class Evaluator:
    """Scores the weights the generator pool holds on every task's held-out prompts.

    Args:
        pool: a ``GeneratorPool`` (``generate(prompts, n, temperature=...)``, ``push``, ``versions``).
        eval_by_task: task name -> held-out prompts (:func:`split_eval_prompts`).
        kinds: task name -> ``TaskConfig.kind``.
        reward_fns: task name -> ``(prompts, completions) -> rewards`` (the trainer's scorers).
        eval_cfg: ``EvalConfig`` (``samples``, ``temperature``, ``pass_at_k``, ``kl_ref``).
        sample_temperature: ``generators.temperature`` (used when ``eval.temperature`` is null).
        log: console lines (None: silent): one as the eval starts, one every
            ``progress_every_s`` seconds while it generates, and its result
            (:func:`format_eval_line`).
        reference: the learner's reference pass for ``eval.kl_ref``: ``reference(input_ids [B][S],
            loss_mask [B][S], temperature)`` submits it and returns a function that waits for
            ``{"logprobs": [B, S], "reference_version": int}`` (the trainer wraps
            ``MegatronLearner.reference_logprobs``); None: no reference model here, no ``kl_ref``.
        gold_fns: task name -> scorer like ``reward_fns`` of the task's ``tasks[].eval_reward``
            (reward-model tasks; the gold judge of ``win_rate``); None: none.
    """

    def __init__(self, pool, eval_by_task: dict[str, list[Prompt]], kinds: dict[str, str],
                 reward_fns: dict[str, Callable], eval_cfg, sample_temperature: float,
                 log: Callable[[str], None] | None = None, progress_every_s: float = 30.0,
                 reference: Callable | None = None, gold_fns: dict[str, Callable] | None = None):
        self.pool, self.eval_by_task, self.kinds, self.reward_fns = pool, eval_by_task, kinds, reward_fns
        self.gold_fns = dict(gold_fns or {})
        bad = [t for t in self.gold_fns if kinds.get(t) != "reward_model"]
        if bad:
            raise ValueError(f"Evaluator: gold scorers for {bad}, which are not reward-model tasks")
        self.base: dict[str, dict[str, dict[int, float]]] = {}   # task -> judge -> prompt id -> score
        self.samples = eval_cfg.samples
        self.pass_ks = list(getattr(eval_cfg, "pass_at_k", ()) or ())
        self.temperature = eval_cfg.temperature if eval_cfg.temperature is not None else sample_temperature
        self.log, self.progress_every_s = log, progress_every_s
        self.reference = reference
        self.kl_ref = bool(getattr(eval_cfg, "kl_ref", False))
        self.kl_skipped = None   # why eval.kl_ref gives no value (None: it does, or it is off)
        if self.kl_ref:
            if self.samples == 0:
                self.kl_skipped = ("eval.samples=0: no sampled completions to measure it on (eval.samples=1 "
                                   "adds one per prompt)")
            elif reference is None:
                self.kl_skipped = ("no reference model loaded (the learner holds it; tools/evaluate.py "
                                   "runs a generator alone)")
        self._told = False

    def set_base(self, rows: list[dict]) -> bool:
        """Take the starting policy's reply scores (of :func:`win_rate_metrics`) from the metrics
        row of the eval before step 1 (``eval/step`` 0) among ``rows``: a resumed run's first
        session's. Returns whether that row was there (without it a resumed run has no win rates)."""
        records = [rec for r in rows for rec in (*(r.get("eval/earlier") or []), r)]   # a 1-step run's
        for row in records:                                                            # first eval rides along
            if row.get("eval/step") == 0:
                self.base = {}
                for t, kind in self.kinds.items():
                    ids = row.get(f"eval/{t}/ids")
                    if kind != "reward_model" or not isinstance(ids, list):
                        continue
                    for judge, key in (("proxy", "outcomes"), ("gold", "gold_outcomes")):
                        vals = row.get(f"eval/{t}/{key}")
                        if isinstance(vals, list) and len(vals) == len(ids):
                            self.base.setdefault(t, {})[judge] = {int(i): float(v) for i, v in zip(ids, vals)}
                return True
        return False

    def evaluate(self, step: int, weights=None) -> dict:
        """Push ``weights`` (a ``PublishedWeights``; None: what the pool holds) to every worker
        that holds an older version, then score every task (module docstring); waits for the
        reference pass of ``kl_ref`` (:meth:`start` and its finishing function in one call).

        Returns:
            the row fields: ``eval/step`` = ``step``, ``eval/weight_version``, ``eval/k``,
            ``time/eval_s`` (push + generation + scoring seconds), ``eval/<task>/...``; with
            ``kl_ref`` also ``eval/reference_version`` and ``time/eval_kl_ref_s`` (seconds from the
            reference pass's submission to its result, overlapping other work).
        Raises:
            RuntimeError: a completion came from another weight version than the one evaluated.
        """
        return self.start(step, weights)()

    def start(self, step: int, weights=None) -> Callable[[], dict]:
        """Generate and score (as :meth:`evaluate`) and submit the reference pass of ``kl_ref``;
        returns the function that waits for that pass and gives :meth:`evaluate`'s fields (it
        logs the result line). Generation-side errors raise here, the reference pass's in it."""
        t0 = time.perf_counter()
        if weights is not None and weights.version > min(self.pool.versions()):
            self.pool.push(weights, only_stale=True)
        version = min(self.pool.versions())
        tasks = [t for t, ps in self.eval_by_task.items() if ps]   # a task too small to hold any out: none
        prompts = [p for t in tasks for p in self.eval_by_task[t]]
        math_prompts = [p for p in prompts if self.kinds[p.task] == "math_verify"]
        kl_on = self.kl_ref and self.kl_skipped is None
        sample_prompts = (prompts if kl_on else math_prompts) if self.samples > 0 else []
        label = "eval before step 1" if step == 0 else f"eval after step {step}"
        stage = [f"greedy completions of {len(prompts)} prompts"]
        if self.log is not None:
            what = "prompt (KL to the reference)" if kl_on else "math prompt"
            self.log(f"{label}: " + ", ".join(f"{t} {len(self.eval_by_task[t])}" for t in tasks)
                     + " held-out prompts, greedy" + (f" + {self.samples} samples of each {what}"
                                                     if sample_prompts else "") + "...")
            if self.kl_skipped is not None and not self._told:   # once per run
                self.log(f"eval: no KL to the reference (eval.kl_ref): {self.kl_skipped}")
                self._told = True
        with _Heartbeat(self.log, lambda: f"{label}: {stage[0]}... {time.perf_counter() - t0:.0f} s",
                        self.progress_every_s):
            greedy = self.pool.generate(prompts, 1, temperature=0.0)
            stage[0] = (f"{self.samples} sampled completions of {len(sample_prompts)} "
                        + ("prompts" if kl_on else "math prompts"))
            sampled = (self.pool.generate(sample_prompts, self.samples, temperature=self.temperature)
                       if sample_prompts else [])
            seen = {v for g in (*greedy, *sampled) for c in g
                    for v in (c.weight_version, getattr(c, "weight_version_last", c.weight_version))}
            if seen - {version}:   # (no eval prompt at all: nothing generated, nothing to check)
                raise RuntimeError(f"eval at step {step}: completions came from weight versions {sorted(seen)}, "
                                   f"expected only {version} (a weight push during the eval)")
            t_ref = time.perf_counter()
            wait_ref = self._submit_reference(sample_prompts, sampled) if kl_on and sampled else None
            stage[0] = "scoring"
            by_prompt = {id(p): g for p, g in zip(sample_prompts, sampled)}
            math_sampled = [by_prompt[id(p)] for p in math_prompts] if sampled else []
            greedy_r = self._score(prompts, [[g[0]] for g in greedy])
            sampled_r = self._score(math_prompts, math_sampled) if math_sampled else []
            gold_idx = [i for i, p in enumerate(prompts) if p.task in self.gold_fns]
            gold_r = dict(zip(gold_idx, self._score([prompts[i] for i in gold_idx],
                                                    [[greedy[i][0]] for i in gold_idx], self.gold_fns)))
        by_math = {id(p): r for p, r in zip(math_prompts, sampled_r)}
        out: dict = {"eval/step": step, "eval/weight_version": version, "eval/k": self.samples}
        for t in tasks:
            idx = [i for i, p in enumerate(prompts) if p.task == t]
            samp = [by_math[id(prompts[i])] for i in idx] if sampled_r and self.kinds[t] == "math_verify" else None
            out.update(eval_metrics(t, self.kinds[t], [greedy_r[i][0] for i in idx],
                                    [len(greedy[i][0].token_ids) for i in idx], samp, self.pass_ks,
                                    ids=[prompts[i].index for i in idx],
                                    groups=[getattr(prompts[i], "group", "") for i in idx]))
            if self.kinds[t] == "reward_model":
                out.update(self._against_base(t, step, [prompts[i].index for i in idx],
                                              [greedy_r[i][0] for i in idx],
                                              [gold_r[i][0] for i in idx] if t in self.gold_fns else None))
        if self.kl_skipped is not None:
            out[KL_REF_SKIPPED] = self.kl_skipped
        out["time/eval_s"] = time.perf_counter() - t0

        def finish() -> dict:
            if wait_ref is not None:
                out.update(self._kl_fields(sample_prompts, sampled, wait_ref()))
                out["time/eval_kl_ref_s"] = time.perf_counter() - t_ref
            if self.log is not None:
                self.log(format_eval_line(label, out))
            return out
        return finish

    def _against_base(self, task: str, step: int, ids: list[int], proxy: list[float],
                      gold: list[float] | None) -> dict:
        """``gold_reward_mean`` (+ ``/se``, ``gold_outcomes``) and the win rates of one reward-model
        task against the starting policy's replies, recorded here at the eval before step 1."""
        out: dict = {}
        judged = {"proxy": [round(float(v), 4) for v in proxy]}
        if gold is not None:
            judged["gold"] = [round(float(v), 4) for v in gold]
            pre = f"eval/{task}/"
            out[pre + "gold_reward_mean"], out[pre + "gold_reward_mean/se"] = mean_se([float(v) for v in gold])
            out[pre + "gold_outcomes"] = judged["gold"]
        if step == 0:   # the starting policy: every later eval is judged against these replies
            self.base[task] = {j: dict(zip(ids, vals)) for j, vals in judged.items()}
        for judge, name in (("proxy", "proxy_win_rate"), ("gold", "win_rate")):
            if judge in judged and judge in self.base.get(task, {}):
                out.update(win_rate_metrics(task, name, ids, judged[judge], self.base[task][judge]))
        return out

    def _submit_reference(self, prompts: list[Prompt], sampled: list[list]) -> Callable[[], dict]:
        """Submit the reference pass over every sampled completion (prompt + completion tokens,
        right-padded with 0, mask 1 on the completion) at the eval's temperature."""
        rows = [(list(p.token_ids), list(c.token_ids)) for p, g in zip(prompts, sampled) for c in g]
        width = max(len(a) + len(b) for a, b in rows)
        ids = [a + b + [0] * (width - len(a) - len(b)) for a, b in rows]
        mask = [[0] * len(a) + [1] * len(b) + [0] * (width - len(a) - len(b)) for a, b in rows]
        return self.reference(ids, mask, self.temperature)

    def _kl_fields(self, prompts: list[Prompt], sampled: list[list], got: dict) -> dict:
        """``kl_ref_metrics`` of every task from the reference pass ``got`` (row order of
        :meth:`_submit_reference`), plus ``eval/reference_version``."""
        ref = got["logprobs"]
        ref = ref.tolist() if hasattr(ref, "tolist") else ref
        per_task: dict[str, tuple[list, list, list]] = {}
        row = 0
        for j, (p, g) in enumerate(zip(prompts, sampled)):
            pol_l, ref_l, pid_l = per_task.setdefault(p.task, ([], [], []))
            for c in g:
                n, start = len(c.token_ids), len(p.token_ids)
                pol_l.append([float(x) for x in c.logprobs])
                ref_l.append([float(x) for x in ref[row][start:start + n]])
                pid_l.append(j)
                row += 1
        out: dict = {"eval/reference_version": got.get("reference_version")}
        for t, (pol_l, ref_l, pid_l) in per_task.items():
            out.update(kl_ref_metrics(t, pol_l, ref_l, pid_l))
        return out

    def _score(self, prompts: list[Prompt], groups: list[list], fns: dict | None = None) -> list[list[float]]:
        """Rewards ``[prompt][completion]``: one scorer call per task (``fns``: the scorers, default
        the training rewards; :attr:`gold_fns` for the evaluation reward models)."""
        fns = self.reward_fns if fns is None else fns
        key = "eval_reward" if fns is self.gold_fns else "reward"
        out: list[list[float]] = [[] for _ in prompts]
        for t in dict.fromkeys(p.task for p in prompts):
            idx = [i for i, p in enumerate(prompts) if p.task == t]
            ps = [prompts[i] for i in idx for _ in groups[i]]
            texts = [c.text for i in idx for c in groups[i]]
            flat = list(fns[t](ps, texts))
            if len(flat) != len(texts):
                raise ValueError(f"tasks[{t}].{key} returned {len(flat)} rewards for {len(texts)} completions")
            pos = 0
            for i in idx:
                out[i] = [float(x) for x in flat[pos:pos + len(groups[i])]]
                pos += len(groups[i])
        return out


def format_eval_line(label: str, fields: dict) -> str:
    """One console line of an eval's result: ``eval before step 1: math pass@1 78/128 = 0.609 +-
    0.043, mean@k ...; chat reward 0.30 +- 0.08 (95 s)`` (from :meth:`Evaluator.evaluate`'s fields)."""
    parts = []
    for t in dict.fromkeys(k.split("/")[1] for k in fields if k.count("/") == 2 and k.startswith("eval/")):
        pre, n = f"eval/{t}/", fields.get(f"eval/{t}/num_prompts", 0)
        if pre + "pass@1" in fields:
            p = fields[pre + "pass@1"]
            txt = f"{t} pass@1 {round(p * n)}/{n} = {p:.3f} +- {fields[pre + 'pass@1/se']:.3f}"
            if pre + "mean@k" in fields:
                txt += f", mean@{fields.get('eval/k')} {fields[pre + 'mean@k']:.3f}"
        elif pre + "reward_mean" in fields:
            txt = f"{t} reward {fields[pre + 'reward_mean']:.2f} +- {fields[pre + 'reward_mean/se']:.2f}"
            if pre + "gold_reward_mean" in fields:
                txt += f", gold {fields[pre + 'gold_reward_mean']:.2f} +- {fields[pre + 'gold_reward_mean/se']:.2f}"
            for name, what in (("win_rate", "gold win rate"), ("proxy_win_rate", "proxy win rate")):
                if _after_start(fields) and pre + name in fields:
                    txt += f", {what} {fields[pre + name]:.2f} +- {fields[pre + name + '/se']:.2f}"
        else:
            continue
        if pre + "kl_ref" in fields:
            txt += f", KL to the reference {fields[pre + 'kl_ref']:.2e} nats/token"
        parts.append(txt)
    return f"{label}: " + "; ".join(parts) + f" ({fields.get('time/eval_s', 0.0):.0f} s)"


def _after_start(fields: dict) -> bool:
    """Whether an eval's fields are of a later eval than the one before step 1 (where a win rate
    against the starting policy is 0.5 by construction and not worth a console word)."""
    return fields.get("eval/step", 0) != 0


class _Heartbeat:
    """While its block runs, calls ``log(line())`` every ``every_s`` seconds from a daemon thread
    (an eval's progress: generation is one blocking call per stage). No-op when ``log`` is None."""

    def __init__(self, log: Callable[[str], None] | None, line: Callable[[], str], every_s: float):
        self.log, self.line, self.every_s = log, line, every_s
        self._done = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.log is not None and self.every_s > 0:
            self._thread = threading.Thread(target=self._beat, name="eval-progress", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(self.every_s):
            self.log(self.line())

    def __exit__(self, *exc):
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


_CLOSE = object()


class EvalService:
    """Eval requests from the learner loop, served on the thread that owns the generator pool.

    The loop calls :meth:`request` (step, published weights) *before* publishing those weights
    for generation; the rollout producer calls :meth:`serve_pending` at the top of every batch and
    right after its weight handshake, and :meth:`serve_until_closed` after its last batch, so
    an eval always finds the pool at a version <= the one requested and pushes exactly it.

    An eval's generation and scoring run on the calling (producer) thread; its finishing part
    (waiting for the learner's reference pass of ``eval.kl_ref``) on a thread of its own, which
    resolves the request's future.

    Consumes: requests (loop). Waits for: nothing (``serve_pending``) or the next request
    (``serve_until_closed``). Unblocked by: :meth:`request`, :meth:`close`.
    """

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator
        self._q: queue.Queue = queue.Queue()
        self._closed = threading.Event()

    def request(self, step: int, weights=None) -> Future:
        """Queue an eval of ``weights`` (None: the pool's current weights) for row ``step``;
        the future's result is :meth:`Evaluator.evaluate`'s dict, or ``None`` when cancelled."""
        fut = EvalFuture(step)
        self._q.put((step, weights, fut))
        return fut

    def serve_pending(self) -> None:
        """Serve every queued request now (producer thread; returns when the queue is empty)."""
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            self._serve(item)

    def serve_until_closed(self, stop_event: threading.Event) -> None:
        """Serve requests until :meth:`close` (or ``stop_event``); the producer's last phase."""
        while not self._closed.is_set() and not stop_event.is_set():
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            self._serve(item)

    def close(self) -> None:
        """No more requests will come: ``serve_until_closed`` returns once the queue is served."""
        self._q.put(_CLOSE)

    def cancel_pending(self) -> None:
        """Resolve every unserved request with ``None`` (a stopped run)."""
        self._closed.set()
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not _CLOSE:
                item[2].set_result(None)

    def _serve(self, item) -> None:
        if item is _CLOSE:
            self._closed.set()
            return
        step, weights, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        fut.phase = EVAL_GENERATING
        try:
            finish = self.evaluator.start(step, weights)
        except BaseException as e:  # noqa: BLE001 - raised in the loop when it reads the result
            fut.set_exception(e)
            return
        fut.phase = EVAL_FINISHING
        # the reference pass of eval.kl_ref runs on the learner: the row waits for it, the
        # producer does not (it goes on generating; a learner call queued behind a weight export
        # that waits for the producer's push would otherwise never start)
        threading.Thread(target=_resolve, args=(fut, finish), name=f"eval-{step}-finish", daemon=True).start()


EVAL_QUEUED = "queued: the rollout producer has not started it (it is generating a batch or waiting for weights)"
EVAL_GENERATING = "generating and scoring its prompts on the rollout producer's thread"
EVAL_FINISHING = "waiting for the learner's reference pass (eval.kl_ref) after its generation"
"""An eval request's phase, as a timed-out wait for it names it (:class:`EvalFuture`)."""


class EvalFuture(Future):
    """The future of one eval request: its row's ``step`` and its ``phase`` (:data:`EVAL_QUEUED`,
    then set by :meth:`EvalService._serve`), which a timed-out wait names (:class:`PendingRows`)."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.phase = step, EVAL_QUEUED


def _resolve(fut: Future, finish: Callable[[], dict]) -> None:
    """``fut``'s result (or error) is ``finish()``'s (:meth:`Evaluator.start`)."""
    try:
        fut.set_result(finish())
    except BaseException as e:  # noqa: BLE001 - raised in the loop when it reads the result
        fut.set_exception(e)


def eval_due(eval_cfg, num_steps: int, done: int, published: bool) -> bool:
    """Whether the weights after step ``done`` are evaluated: every ``eval.interval`` steps (when
    they are published for generation: the engines only ever hold those) and after the last step."""
    if not eval_cfg.enabled:
        return False
    if done >= num_steps:
        return True
    return bool(eval_cfg.interval) and done % eval_cfg.interval == 0 and published


EARLIER_EVALS = "eval/earlier"
"""Row key for the evals a row holds besides its own: a list of their field dicts, oldest first. Only
a run whose first row also ends it (``run.num_steps=1``) has one: row 1 holds the eval before step 1
here and the final eval in its ``eval/*`` fields (:func:`megatron_rlhf.trainer.metrics.eval_records`
reads both)."""


class PendingRows:
    """Metrics rows waiting for their evals (served on the producer thread), logged in step order.

    A row is written once every eval future attached to it has resolved (the last one's fields
    merged into the row, any earlier one's kept under :data:`EARLIER_EVALS`, ``time/eval_s`` = their
    seconds, 0 without an eval); :meth:`add` writes every leading
    row that is ready without waiting, :meth:`flush` waits for all (before a checkpoint, at the end).

    Args:
        log: ``MetricsLogger.log``.
        thread: the producer thread (an eval it can no longer serve resolves to no fields).
        batches: the producer's queue (its exception, if it failed, is raised).
        timeout: ``async.timeout_s``.
        dump_stacks: ``why -> "stacks of every process: <file>"`` (``Run.dump_stacks``), called
            when a wait for an eval runs out; None: no stacks.
    """

    def __init__(self, log: Callable[[dict], object], thread: threading.Thread, batches: queue.Queue,
                 timeout: float, dump_stacks: Callable[[str], str] | None = None):
        self.log, self.thread, self.batches, self.timeout = log, thread, batches, timeout
        self.dump_stacks = dump_stacks
        self._rows: list[tuple[dict, list]] = []

    def add(self, row: dict, futures: list) -> None:
        """Queue ``row`` with its eval ``futures``; write the rows that are ready."""
        self._rows.append((row, futures))
        while self._rows and all(f.done() for f in self._rows[0][1]):
            self._write(*self._rows.pop(0))

    def flush(self) -> None:
        """Write every queued row, waiting for its evals.

        Raises:
            the first failed eval's error (see :meth:`_result`), after every row is written: a
            row whose eval failed is written without that eval's fields, so the trained steps
            stay in ``metrics.jsonl`` and the caller can still checkpoint them.
        """
        error = None
        while self._rows:
            try:
                self._write(*self._rows.pop(0))
            except Exception as e:   # noqa: BLE001 - re-raised below, once every row is written
                error = error or e
        if error is not None:
            raise error

    def _write(self, row: dict, futures: list) -> None:
        error, results = None, []
        for fut in futures:   # in order: the eval before step 1, then this step's
            try:
                res = self._result(fut)
            except Exception as e:   # noqa: BLE001 - the row is written first, then this is raised
                error, res = error or e, None
            if res:
                results.append(res)
        for res in results:   # the row's own eval fields are the last eval's
            row.update(res)
        if len(results) > 1:   # a 1-step run: row 1 holds the eval before step 1 and the final one
            row[EARLIER_EVALS] = [dict(r) for r in results[:-1]]
        row["time/eval_s"] = sum(r["time/eval_s"] for r in results)
        self.log(row)
        if error is not None:
            raise error

    def _result(self, fut: Future) -> dict | None:
        """The eval's fields; None when it was cancelled or the producer ended without serving it
        (an eval it served and whose reference pass is still running is waited for).

        Raises:
            the eval's own error; ``ProducerError``: generation failed while the eval waited;
            TimeoutError: nothing within ``async.timeout_s``: names the row's step, the eval's phase
            (:data:`EVAL_QUEUED` and the two after it) and the stacks file.
        """
        from megatron_rlhf.rollout.producer import ProducerError

        deadline = time.monotonic() + self.timeout
        while not fut.done():
            try:
                return fut.result(timeout=1.0)
            except TimeoutError:
                pass
            # served (running: its finishing thread resolves it) or not served by a producer that ended
            if not self.thread.is_alive() and not fut.done() and not fut.running():
                try:
                    item = self.batches.get_nowait()
                except queue.Empty:
                    return None
                if isinstance(item, BaseException):
                    raise ProducerError(f"generation failed: {type(item).__name__}: {item}") from item
                return None
            if time.monotonic() > deadline:
                what = f" for the row of step {fut.step}" if isinstance(fut, EvalFuture) else ""
                phase = f": the eval is {fut.phase}" if isinstance(fut, EvalFuture) else ""
                stacks = f"; {self.dump_stacks('eval timeout')}" if self.dump_stacks is not None else ""
                raise TimeoutError(f"no eval result{what} within async.timeout_s={self.timeout:.0f} s{phase}{stacks}")
        return fut.result()
