"""The two papers' findings on a real model: sync vs one-step async, and which losses survive staleness.

Issue 22, issue 34. SmolLM2-135M-Instruct (``model.source: smollm2``) on the demo's math task
alone (``configs/repro_math.yaml``: single-digit multiplication, math-verify, the demo's 128
held-out rows; no chat task, no reward model). Every run is evaluated (greedy pass@1; with
``--eval-samples`` k > 0 also mean@k and the KL to the reference on the eval's fresh samples,
``eval/math/kl_ref``) before step 1, every ``eval.interval`` steps of its cell and after its last
step (``trainer/evaluate.py``).

* **Grid A** (Noukhovitch et al. 2024, "Asynchronous RLHF", Tables 1-2): Online DPO, synchronous
  (``async.sync=true``) vs one-step asynchronous (``max_staleness = 1``), seeds 0, 1, 2; cells
  ``A_sync_s<S>``, ``A_async_s<S>``.
* **Grid B** (Noukhovitch et al. 2024 Fig. 3-4; Lanchantin et al. 2025 Table 1):
  ``async.sync_interval = async.max_staleness = N`` in {1, 4, 16} for online_dpo, grpo and rloo,
  seed 0; cells ``B_<loss>_N<N>``. N = 16 with 16 steps: the generator never receives new weights
  (Lanchantin's offline end). ``B_online_dpo_N1`` *is* ``A_async_s0`` (same config): read, not re-run.
  Defined for issue 34 (item 4): the on-policy points ``B_{grpo,rloo}_onpolicy`` (``async.sync``:
  the papers' N = 1, where Lanchantin's GRPO lives) and ``B_{grpo,rloo}_N16_isnone``
  (``algorithm.is_correction=none`` beside TIS at N = 16).
* **Grid C** (issue 34, items 4 and 6c; the papers' N and estimators): ``sync_interval = N``,
  ``max_staleness = N - 1`` (staleness 0..N-1; N = 1 on-policy), N in {1, 2, 4, 16}, for
  online_dpo, ppo and proximal_rloo; PPO and Proximal RLOO with T = 2 updates per batch
  (``algorithm.updates_per_batch``: the clip acts) and the KL penalty ``algorithm.kl_beta = 0.05``
  (Noukhovitch et al. 2024 Table 4, PPO); carried surplus off (it would reach staleness N); an eval
  every max(8, N) steps for the frontier. Cells ``C_<loss>_N<N>_s<seed>``: seed 0 is group ``C``,
  seeds 1-2 the optional group ``Cseeds``.
* **Grid L** (issue 34, item 6a; Noukhovitch et al. 2024 Tables 1-2, lag-matched): Online DPO,
  sync 16 steps (``L_sync_s<S>``) against one-step async 17 steps (``L_async_s<S>``), seeds 0-7, an
  eval every 4 steps. Async update k trains on samples of pi_{k-2}, sync's on pi_{k-1}: async's
  17th update is the first to use the version sync's 16th used, so async@17 - sync@16 is the
  comparison with the one-step data lag removed, async@16 - sync@16 grid A's (:func:`lag_matched`).
  Grid L's async arm keeps the demo's carried surplus (``algorithm.carry_surplus``, carry bound 2):
  4-9% of its trained samples were two versions old, so it is one-step async plus a few two-step
  leftovers (grid A's had none).
  **Grid L48** (item 6b): the same at 48 vs 49 steps, seeds 0-2, an eval every 8 steps, with the
  carried surplus off in both arms (strictly one-step, as the papers run it).
* **Pilot** (cells ``P_<loss>_lr<lr>``): each loss's learning rate is chosen by a short run at
  N = 1 (``--pilot-steps`` steps, one-step async, seed 0, the loss's estimator overrides) per lr of
  ``--pilot-lrs``, scored on a *validation* slice of the training prompts (the task's ``eval_data``
  dropped, so the evaluator holds out 64 training rows, sha256 order, and trains on the rest) and
  never on the held-out test rows. The choice: the lr with the largest validation pass@1 gain (ties:
  the smaller lr); then fixed across N, as the paper does. Grids A and B's Online DPO keep the
  demo's lr (3e-6, which learned in 3 of 3 seeds: bench/RESULTS.md); grid C's Online DPO, PPO and
  Proximal RLOO take their pilots' (``P_online_dpo_*``, ``P_ppo_*``, ``P_proximal_rloo_*``). A
  cell without a fixed lr runs its loss's missing pilot cells first.

    nice -n 15 python bench/seeds_repro.py                  # everything but Cseeds; resumable
    nice -n 15 python bench/seeds_repro.py --only A         # grid A (or B, P, L, L48, C, Cseeds, or cell names)
    python bench/seeds_repro.py --list                      # every cell: group, finished or not
    python bench/seeds_repro.py --table                     # only rewrite results.md and the plots
    python bench/seeds_repro.py --dry-run --out /tmp/x      # tiny random model, 2 steps per cell

Resumable: each finished run writes ``OUT/<cell>.json``; a re-run skips every cell whose JSON
exists (an interrupted cell starts again from step 0: ``checkpoint.interval: 0``). Per cell the
JSON holds the config overrides, the eval before/after with standard errors, the gain and its
z-score (computed as in ``bench/demo_seeds.py``), KL to the reference (``kl/ref_k1``/``k3``: mean
over the last 4 steps, the batch's own samples), the staleness, the loop's wall time
(``summary.json`` ``wall_s``: setup excluded), the 1-minute load average sampled every 15 s during
the run, and per step every ``logprobs/*``, ``tis/*``, ``staleness/*``, ``kl/*``, reward and time
key of ``metrics.jsonl`` (so the mismatch paid for staleness sits next to quality); ``outcomes``:
the greedy 0/1 of every eval prompt before and after (``eval/math/outcomes``), their row ids and
product ids, each eval's step and weight version and cluster-robust se (intermediate evals too);
``gain_paired``: the gain's paired se; ``started``: the commit and a dirty flag when the cell
started (``commit``: when it finished); ``curve``: every eval's step, loop wall seconds, pass@1,
gain and KL on fresh samples (``kl_ref``: the after-eval's). After each run it rewrites
``OUT/results.md`` and the plots ``gain_vs_N.png``, ``gain_vs_wall.png`` (gain at every eval
against loop wall time) and ``frontier.png`` (gain against ``kl_ref``, one line per N;
``bench/seeds_repro_plots.py``).

One Ray cluster and one vLLM generator (``setup.build_generators`` of the first cell's config,
reset to the base weights at each run's start and reseeded per batch, so results do not depend on
the order the cells run in) serve every cell of an invocation, as ``bench/offpolicy_sweep.py``
(which this replaces) did.

Statistics. Gain = after - before of held-out greedy pass@1; z = gain / sqrt(se_b^2 + se_a^2)
(``demo_seeds.seed_row``; the evals treated as independent: conservative). The greedy "before" is
identical in every cell (same base weights, greedy decoding), so a difference of two cells' gains
is a difference of afters (:func:`gain_diff`): paired over prompts (McNemar: the se of the
per-prompt differences) when both cells store per-prompt outcomes (``outcomes``: the eval rows'
``eval/math/outcomes`` and ids, from ``trainer/evaluate.py``), else the unpaired
sqrt(after_se1^2 + after_se2^2) (never the gain ses, which count the shared before twice). Async -
sync over seeds: the mean of the per-seed differences with sd/sqrt(n), its t-interval (the t
multiplier of n - 1 df), the exact sign-flip p over the 2^n sign patterns and the exact unpaired
permutation p of the afters. Cells with outcomes also carry a cluster-robust se by product (the
eval's wordings and orders of one product are not independent). Each cell records the commit and
a dirty flag at its start (``started``). Wall times measured under load (the
load average is recorded beside each) are not the paper's comparison; quality numbers are valid
under load (the handshake bounds staleness whatever the speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import seeds_repro_plots as plots  # noqa: E402 - bench/ is on the path from here

RECIPE = REPO / "configs" / "repro_math.yaml"
DPO_LR = 3.0e-6            # cpu_demo.yaml's lr: learned in 3 of 3 seeds (bench/RESULTS.md)
PILOT_LRS = (1.0e-6, 3.0e-6, 1.0e-5)
N_VALUES = (1, 4, 16)
B_LOSSES = ("online_dpo", "grpo", "rloo")
SEEDS = (0, 1, 2)
TAIL = 4                   # KL = mean over the last TAIL steps
PER_STEP_PREFIXES = ("logprobs/", "tis/", "staleness/", "kl/", "reward/mean", "time/", "pairs/count",
                     "loss/total", "pg/", "entropy/", "prompts/", "generator/weight_version")
# Policy-gradient losses train every completion of a group: 4 prompts x K=4 = 16 sequences a step,
# as many as Online DPO's 6 pairs x 2 + a margin; Online DPO keeps the demo's K = 8 (pairs of best
# vs worst of 8).
PG_SHAPE = ["algorithm.samples_per_prompt=4", "algorithm.prompts_per_step=4"]
# The papers' estimators (issue 34, item 4). PPO and Proximal RLOO: T = 2 optimizer steps per batch
# (algorithm.updates_per_batch), so pi_old (the recompute before the first update) differs from
# pi_theta on the second update and the clip acts (at T = 1 it is inert: ratio exactly 1), and the
# KL penalty of Noukhovitch et al. 2024 (beta = 0.05 for PPO, Table 4; algorithm.kl_beta, in the
# reward with pi_old, k1, as Ouyang et al. 2022 eq. 2). pi_old = the behaviour policy (the
# generator's logprobs) is not an option of the learner; the TIS weight pi_old / pi_generator
# corrects for the generator instead.
PAPERS_ESTIMATOR = ["algorithm.updates_per_batch=2", "algorithm.kl_beta=0.05"]
PAPERS_N = (1, 2, 4, 16)   # grid C: sync_interval = N, max_staleness = N - 1 (N = 1: on-policy)
C_LOSSES = ("online_dpo", "ppo", "proximal_rloo")
C_SEEDS = (0, 1, 2)        # seed 0 in the default run (group C); seeds 1-2 optional (group Cseeds)
C_EVAL_EVERY = 8           # grid C evaluates every max(8, N) steps: points along each run's frontier
# carried work would reach staleness N (max_staleness + 1): off in grid C, so staleness is 0..N-1
C_EXTRA = ["algorithm.carry_surplus=false"]
LAG_SEEDS = tuple(range(8))  # grid L: lag-matched sync 16 vs async 17 steps, seeds 0-7 (issue 34, item 6a)
LAG_EVAL_EVERY = 4
LONG_STEPS, LONG_SEEDS, LONG_EVAL_EVERY = 48, (0, 1, 2), 8   # grid L48: the same, 48 vs 49 steps (item 6b)
OPTIONAL_GROUPS = ("Cseeds",)   # not in the default run (``--only Cseeds``)
EVAL_SAMPLES = 1           # sampled completions per eval prompt: mean@1 and the KL on fresh samples
DRY_TASK = {"name": "math", "reward": "megatron_rlhf.rewards.synthetic:letter_rate", "instruction": "",
            "data": {"path": "data/arithmetic/mul1.jsonl", "prompt_field": "input", "answer_field": "target"},
            "eval_data": {"path": "data/arithmetic/mul1_eval.jsonl", "prompt_field": "input",
                          "answer_field": "target"}}


@dataclass
class Cell:
    """One run of the grid: its name, group (A, P, B, L, L48, C, Cseeds) and what it sets."""

    name: str
    group: str
    loss: str
    sync: bool = False
    n: int = 1                   # async.sync_interval = async.max_staleness (ignored when sync)
    seed: int = 0
    lr: float | None = None      # None: the loss's pilot choice
    pilot: bool = False          # validation slice of the training rows instead of the test rows
    alias: str | None = None     # same config as this cell: its result is read, not re-run
    extra: list[str] = field(default_factory=list)
    papers_n: bool = False       # N as the papers: sync_interval = N, max_staleness = N - 1
    vs: list[str] = field(default_factory=list)   # cells its gain is compared with (gain_diff)
    eval_interval: int = 0       # eval.interval (0: before step 1 and after the last only)
    steps: int | None = None     # learner steps of a real run (None: ``--steps``; a dry run always ``--steps``)
    step_offset: int = 0         # steps added to that (grid L's async arm: one more, the lag-matched step)


def estimator(loss: str) -> list[str]:
    """The overrides that make ``loss`` the papers' estimator: the PG batch shape, plus T = 2 and
    the KL penalty for PPO and Proximal RLOO (:data:`PAPERS_ESTIMATOR`); none for Online DPO."""
    if loss in ("ppo", "proximal_rloo"):
        return list(PG_SHAPE) + list(PAPERS_ESTIMATOR)
    return list(PG_SHAPE) if loss != "online_dpo" else []


def lr_tag(lr: float) -> str:
    """``1e-06`` -> ``1e-6`` (cell names)."""
    m, e = f"{lr:.0e}".split("e")
    return f"{m}e{int(e)}"


def grid(pilot_lrs=PILOT_LRS) -> list[Cell]:
    """Every cell, in the order ``python bench/seeds_repro.py`` runs them: A seed 0, the PG pilots,
    B, A seeds 1-2 (all run, 2026-12-01/02), then the cells defined for issue 34 (not run yet):
    B's on-policy PG points and TIS off at N = 16, grid L (lag-matched sync 16 vs async 17, seeds
    0-7), grid L48 (48 vs 49 steps, seeds 0-2), the pilots of Online DPO, PPO and Proximal RLOO,
    grid C seed 0, and (optional) grid C seeds 1-2."""
    def a(seed):
        return [Cell(f"A_sync_s{seed}", "A", "online_dpo", sync=True, seed=seed, lr=DPO_LR),
                Cell(f"A_async_s{seed}", "A", "online_dpo", n=1, seed=seed, lr=DPO_LR)]

    def pilots(loss):
        return [Cell(f"P_{loss}_lr{lr_tag(lr)}", "P", loss, lr=lr, pilot=True, extra=estimator(loss))
                for lr in pilot_lrs]

    def b(loss):
        out = []
        for n in N_VALUES:
            vs = [] if n == 1 else [f"B_{loss}_N1"] + ([f"B_{loss}_onpolicy"] if loss != "online_dpo" else [])
            if loss == "online_dpo":
                out.append(Cell(f"B_{loss}_N{n}", "B", loss, n=n, lr=DPO_LR,
                                alias="A_async_s0" if n == 1 else None, vs=vs))
            else:
                out.append(Cell(f"B_{loss}_N{n}", "B", loss, n=n, extra=estimator(loss), vs=vs))
        return out

    def b_more(loss):   # the on-policy point (papers' N = 1) and N = 16 without the correction
        return [Cell(f"B_{loss}_onpolicy", "B", loss, sync=True, extra=estimator(loss)),
                Cell(f"B_{loss}_N16_isnone", "B", loss, n=16, extra=estimator(loss) + ["algorithm.is_correction=none"],
                     vs=[f"B_{loss}_N16"])]

    def c(loss, seed):
        group = "C" if seed == 0 else "Cseeds"
        return [Cell(f"C_{loss}_N{n}_s{seed}", group, loss, sync=n == 1, n=n, seed=seed, papers_n=True,
                     extra=estimator(loss) + list(C_EXTRA), eval_interval=max(C_EVAL_EVERY, n),
                     vs=[] if n == 1 else [f"C_{loss}_N1_s{seed}"]) for n in PAPERS_N]

    def lag(group, seed, steps, every, extra=()):   # sync N steps vs async N + 1: async's last update
        # is the first to use data from the version sync's last update used (Noukhovitch's one-step lag)
        return [Cell(f"{group}_sync_s{seed}", group, "online_dpo", sync=True, seed=seed, lr=DPO_LR,
                     steps=steps, eval_interval=every, extra=list(extra)),
                Cell(f"{group}_async_s{seed}", group, "online_dpo", n=1, seed=seed, lr=DPO_LR, steps=steps,
                     step_offset=1, eval_interval=every, extra=list(extra), vs=[f"{group}_sync_s{seed}"])]

    cells = a(0) + pilots("grpo") + pilots("rloo")
    for loss in B_LOSSES:
        cells += b(loss)
    cells += a(1) + a(2)
    for loss in ("grpo", "rloo"):
        cells += b_more(loss)
    for seed in LAG_SEEDS:
        cells += lag("L", seed, None, LAG_EVAL_EVERY)
    for seed in LONG_SEEDS:
        cells += lag("L48", seed, LONG_STEPS, LONG_EVAL_EVERY, C_EXTRA)   # strictly one-step: no carry
    for loss in C_LOSSES:
        cells += pilots(loss)
    for seed in C_SEEDS:
        for loss in C_LOSSES:
            cells += c(loss, seed)
    return cells


def select(cells: list[Cell], only: list[str] | None) -> list[Cell]:
    """The cells ``--only`` names (groups A, B, P, L, L48, C, Cseeds or cell names), in grid order; none
    named: every cell but the optional groups (:data:`OPTIONAL_GROUPS`).

    Raises:
        SystemExit: a name that is neither a group nor a cell (the valid names listed).
    """
    if not only:
        return [c for c in cells if c.group not in OPTIONAL_GROUPS]
    names = {c.name for c in cells}
    groups = {c.group for c in cells}
    bad = [x for x in only if x not in names and x not in groups]
    if bad:
        raise SystemExit(f"--only: unknown {' '.join(bad)}: name a group ({' '.join(sorted(groups))}) or a "
                         "cell (`--list` prints every cell and whether it has run)")
    return [c for c in cells if c.name in only or c.group in only]


# ----- configs --------------------------------------------------------------------------------


def overrides(cell: Cell, lr: float, args, model_dir: str) -> list[str]:
    """The ``key=value`` overrides of ``cell`` over the recipe (stored in the run's JSON)."""
    if cell.pilot:
        steps = args.pilot_steps
    else:
        steps = (cell.steps if cell.steps and not args.dry_run else args.steps) + cell.step_offset
    out = [f"model.source={model_dir}", f"run.output_dir={args.runs}", f"run.name={cell.name}",
           f"run.num_steps={steps}", f"run.seed={cell.seed}", f"algorithm.loss={cell.loss}",
           f"learner.optimizer.lr={lr}", "checkpoint.resume=false", "logging.progress=false",
           "logging.tensorboard=false"]
    if cell.sync:   # on-policy (also the papers' N = 1)
        out += ["async.sync=true", "async.max_staleness=1", "async.sync_interval=1"]
    elif cell.papers_n:   # the papers' N: staleness 0, 1, ..., N - 1 (the generator waits at each sync)
        out += ["async.sync=false", f"async.max_staleness={cell.n - 1}", f"async.sync_interval={cell.n}"]
    else:   # grid B's N: one step of async lag on top (staleness 1..N in steady state)
        out += ["async.sync=false", f"async.max_staleness={cell.n}", f"async.sync_interval={cell.n}"]
    every = min(cell.eval_interval, args.steps) if args.dry_run and cell.eval_interval else cell.eval_interval
    out += [f"eval.samples={args.eval_samples}", f"eval.interval={every}", "eval.kl_ref=true"]
    out += list(cell.extra)
    if cell.pilot:   # validation slice of the training rows: the task without its eval_data
        task = dict(DRY_TASK if args.dry_run else _recipe_task())
        task.pop("eval_data", None)
        out += ["tasks=" + json.dumps([task]), f"eval.num_prompts={args.pilot_eval_prompts}",
                "eval.holdout_frac=0.34"]   # 64 of mul1.jsonl's 196 rows (floor(0.34 x 196) = 66 >= 64)
    return out + list(args.override)


def _recipe_task() -> dict:
    import yaml

    return yaml.safe_load(RECIPE.read_text())["tasks"][0]


def recipe(args) -> Path:
    """The YAML the cells override: ``configs/repro_math.yaml``, or for ``--dry-run`` a tiny
    variant (synthetic reward, 16 new tokens, 8 eval prompts) written under ``args.runs``."""
    if not args.dry_run:
        return RECIPE
    import yaml

    path = Path(args.runs) / "dry_run.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "defaults": str(RECIPE), "tasks": [DRY_TASK],
        "generators": {"max_new_tokens": 16, "max_model_len": 256, "prompts_per_request": 4,
                       "kv_cache_gib": 0.0625},
        "algorithm": {"samples_per_prompt": 4, "prompts_per_step": 2},
        "learner": {"micro_batch_size": 2},
        "eval": {"num_prompts": 8, "samples": 2}}))
    return path


def load(args, cell: Cell, lr: float, model_dir: str):
    from megatron_rlhf.config import load_config

    ov = overrides(cell, lr, args, model_dir)
    return load_config(recipe(args), ov), ov


# ----- reading results ------------------------------------------------------------------------


def _eval_metric(ev: dict) -> str:
    return "pass@1" if "pass@1" in ev else "reward_mean"


def eval_outcomes(rows: list[dict], task: str = "math") -> dict | None:
    """The per-prompt greedy outcomes of the run's first and last eval of ``task`` (metrics rows'
    ``eval/<task>/outcomes``, ``ids``, ``groups``: ``trainer.evaluate``), with each eval's step,
    weight version and cluster-robust se; None when the rows hold no outcomes (runs before them)."""
    from megatron_rlhf.trainer.metrics import eval_records

    evs = [e for e in eval_records(rows) if e.get(f"eval/{task}/outcomes") is not None]
    if not evs:
        return None
    first, last, pre = evs[0], evs[-1], f"eval/{task}/"
    return {"before": first[pre + "outcomes"], "after": last[pre + "outcomes"], "ids": last.get(pre + "ids"),
            "groups": last.get(pre + "groups"), "before_step": first.get("eval/step"),
            "after_step": last.get("eval/step"), "before_weight_version": first.get("eval/weight_version"),
            "after_weight_version": last.get("eval/weight_version"),
            "before_se_cluster": first.get(pre + "pass@1/se_cluster"),
            "after_se_cluster": last.get(pre + "pass@1/se_cluster"),
            "intermediate": [{"step": e.get("eval/step"), "pass@1": e.get(pre + "pass@1"),
                              "outcomes": e[pre + "outcomes"]} for e in evs[1:-1]]}


def eval_curve(rows: list[dict], task: str = "math") -> list[dict]:
    """Every eval of the run (before step 1, every ``eval.interval`` steps, after the last) in step
    order: ``step``, ``weight_version``, ``wall_s`` (loop seconds up to that eval's weights: the sum of
    the rows' ``time/step_s`` through its step; 0 for the eval before step 1), ``value`` and ``se``
    (pass@1, or reward_mean for a non-math task), ``gain`` (value - the first eval's), ``kl_ref``
    with ``kl_ref_se`` and ``kl_ref_seq`` (KL to the reference on the eval's fresh samples,
    ``trainer.evaluate``; None in runs without it) and ``reference_version``."""
    from megatron_rlhf.trainer.metrics import eval_records

    walls, acc = {}, 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        acc += r.get("time/step_s") or 0.0
        walls[r["step"]] = acc
    pre, out = f"eval/{task}/", []
    for e in eval_records(rows):
        key = "pass@1" if pre + "pass@1" in e else "reward_mean"
        if e.get(pre + key) is None:
            continue
        step = e.get("eval/step") or 0
        out.append({"step": step, "weight_version": e.get("eval/weight_version"),
                    "wall_s": walls.get(step, 0.0) if step else 0.0, "value": e[pre + key],
                    "se": e.get(pre + key + "/se"), "kl_ref": e.get(pre + "kl_ref"),
                    "kl_ref_se": e.get(pre + "kl_ref/se"), "kl_ref_seq": e.get(pre + "kl_ref_seq"),
                    "reference_version": e.get("eval/reference_version")})
    out.sort(key=lambda c: c["step"])
    for c in out:
        c["gain"] = c["value"] - out[0]["value"]
    return out


def cell_result(cell: Cell, lr: float, ov: list[str], summary: dict, rows: list[dict], load_avg: dict,
                call_wall_s: float, started: dict | None = None) -> dict:
    """The JSON of one finished cell (see the module docstring) from the run's summary and rows;
    ``started``: :func:`provenance` taken when the cell started (the code that ran)."""
    ev = summary["eval"]["math"]
    key = _eval_metric(ev)
    e = ev[key]
    gain = e["last"] - e["first"]
    se = math.hypot(e["first_se"] or 0.0, e["last_se"] or 0.0)
    tail = rows[-TAIL:]

    def tmean(k, rs=tail):
        vals = [r[k] for r in rs if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        return sum(vals) / len(vals) if vals else None

    per_step = [{k: v for k, v in r.items() if k == "step" or k.startswith(PER_STEP_PREFIXES)} for r in rows]
    outcomes = eval_outcomes(rows)   # before and after share the eval's prompts and order
    curve = eval_curve(rows)
    kl = ({"before": curve[0]["kl_ref"], "after": curve[-1]["kl_ref"], "after_se": curve[-1]["kl_ref_se"],
           "after_seq": curve[-1]["kl_ref_seq"]} if curve and curve[-1]["kl_ref"] is not None else None)
    mk = ev.get("mean@k")
    return {
        "cell": asdict(cell), "lr": lr, "overrides": ov, "metric": key,
        "before": e["first"], "before_se": e["first_se"], "after": e["last"], "after_se": e["last_se"],
        "gain": gain, "gain_se": se, "z": gain / se if se > 0 else None,
        "mean@k": ({"before": mk["first"], "before_se": mk["first_se"], "after": mk["last"],
                    "after_se": mk["last_se"]} if mk else None),
        "len_tokens": ({"before": ev["len_mean_tokens"]["first"], "after": ev["len_mean_tokens"]["last"]}
                       if "len_mean_tokens" in ev else None),
        "kl_k1": tmean("kl/ref_k1"), "kl_k3": tmean("kl/ref_k3"),
        "kl_k1_max": max((r["kl/ref_k1"] for r in rows if r.get("kl/ref_k1") is not None), default=None),
        "staleness_mean": tmean("staleness/mean", rows), "staleness_max": max(
            (r.get("staleness/max") or 0 for r in rows), default=0),
        "token_mult_prob_error_mean": tmean("logprobs/token_mult_prob_error", rows),
        "tis_weight_mean": tmean("tis/weight_mean", rows), "tis_capped_frac": tmean("tis/capped_frac", rows),
        "reward_first": summary.get("reward_first"), "reward_last": summary.get("reward_last"),
        "steps": summary["steps"], "loop_wall_s": summary["wall_s"], "call_wall_s": call_wall_s,
        "gen_s_mean": summary.get("gen_s_mean"), "train_s_mean": summary.get("train_s_mean"),
        "async_speedup": summary.get("async_speedup"), "load": load_avg, "data": summary.get("data"),
        "kl_ref": kl, "curve": curve,
        "per_step": per_step, "outcomes": outcomes, "started": started,
        "gain_paired": (paired_outcome_diff({"outcomes": outcomes["after"], "ids": outcomes["ids"],
                                             "groups": outcomes["groups"]},
                                            {"outcomes": outcomes["before"], "ids": outcomes["ids"]})
                        if outcomes else None),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit(),
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(out: Path | None = None) -> dict:
    """The code a cell is about to run: ``{"commit", "dirty", "utc"}`` (``git rev-parse --short
    HEAD``; ``dirty`` = tracked files differ from it, ``git status --porcelain --untracked-files=no``,
    leaving out the results folder ``out`` when it is inside the repository: the harness rewrites
    ``results.md`` and the plots there after every cell, which is no change of code; None where git
    is not available). Taken at the *start* of a cell (``commit`` in a cell JSON is the one at its
    end)."""
    dirty = None
    spec = ["--", "."]
    if out is not None:
        try:
            spec.append(f":(exclude){Path(out).resolve().relative_to(REPO)}")
        except ValueError:   # a results folder outside the repository
            pass
    try:
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *spec], cwd=REPO,
                            capture_output=True, text=True, timeout=30)
        dirty = bool(st.stdout.strip()) if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": _commit(), "dirty": dirty, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def read_results(out: Path) -> dict[str, dict]:
    """Every finished cell's JSON under ``out`` by cell name."""
    res = {}
    for p in sorted(out.glob("*.json")):
        d = json.loads(p.read_text())
        if isinstance(d, dict) and "cell" in d:
            res[d["cell"]["name"]] = d
    return res


def pilot_choice(results: dict[str, dict], loss: str, pilot_lrs) -> tuple[float | None, list[dict]]:
    """The pilot's lr for ``loss``: the largest validation gain over ``pilot_lrs`` (ties: the smaller
    lr); None while a pilot cell is missing. Also returns the pilot rows found."""
    rows = [results.get(f"P_{loss}_lr{lr_tag(lr)}") for lr in pilot_lrs]
    found = [r for r in rows if r is not None]
    if len(found) < len(pilot_lrs):
        return None, found
    best = max(found, key=lambda r: (round(r["gain"], 9), -r["lr"]))
    return best["lr"], found


# ----- statistics -----------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Numerical Recipes 6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta ``I_x(a, b)`` (Numerical Recipes 6.4, eq. 6.4.5-6.4.6)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1.0 - x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p of Student's t statistic ``t`` with ``df`` degrees of freedom:
    ``I_{df / (df + t^2)}(df / 2, 1 / 2)`` (Abramowitz and Stegun 26.7.1; df = 2: ``1 - |t| / sqrt(2 + t^2)``).

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"t_two_sided_p: df={df}, need >= 1")
    if not math.isfinite(t):
        return 0.0
    return _betai(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` degrees of freedom, by bisection on
    :func:`t_two_sided_p` (``t_quantile(0.975, 2)`` = 4.303, the multiplier of a 95% interval of 3 seeds).

    Raises:
        ValueError: ``q`` not in (0.5, 1) or ``df < 1``.
    """
    if not 0.5 < q < 1.0:
        raise ValueError(f"t_quantile: q={q}, need 0.5 < q < 1")
    target, lo, hi = 2.0 * (1.0 - q), 0.0, 1.0
    while t_two_sided_p(hi, df) > target:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return (lo + hi) / 2.0


def t_interval(values: list[float], level: float = 0.95) -> dict:
    """Mean of ``values`` (one per seed) with its se = sd / sqrt(n), the t multiplier of a ``level``
    interval (df = n - 1), the interval, t = mean / se and its two-sided p (None entries below 2 values).
    """
    n = len(values)
    out = {"n": n, "mean": statistics.mean(values) if values else None, "sd": None, "se": None, "t_mult": None,
           "lo": None, "hi": None, "t": None, "p_two_sided": None, "level": level}
    if n < 2:
        return out
    sd = statistics.stdev(values)
    se, mult = sd / math.sqrt(n), t_quantile(0.5 + level / 2.0, n - 1)
    t = out["mean"] / se if se > 0 else math.copysign(math.inf, out["mean"]) if out["mean"] else 0.0
    out.update(sd=sd, se=se, t_mult=mult, lo=out["mean"] - mult * se, hi=out["mean"] + mult * se, t=t,
               p_two_sided=t_two_sided_p(t, n - 1) if se > 0 else (0.0 if out["mean"] else 1.0))
    return out


def sign_flip_p(diffs: list[float]) -> dict:
    """Exact sign-flip (paired permutation) test of mean(``diffs``) = 0 over seeds: every one of the
    2^n sign patterns; ``less`` = share of patterns whose mean is <= the observed one, ``greater`` >=,
    ``two_sided`` = share with |mean| >= |observed| (3 of 3 negative: 1/8 = 0.125 one-sided).
    Source: Fisher 1935 (The Design of Experiments, sec. 21); Good 2005 (Permutation Tests, ch. 3).
    """
    import itertools

    n = len(diffs)
    if n == 0:
        return {"n": 0, "less": None, "greater": None, "two_sided": None}
    obs, eps = sum(diffs) / n, 1e-12
    means = [sum(s * d for s, d in zip(signs, diffs)) / n for signs in itertools.product((1, -1), repeat=n)]
    k = len(means)
    return {"n": n, "less": sum(m <= obs + eps for m in means) / k, "greater": sum(m >= obs - eps for m in means) / k,
            "two_sided": sum(abs(m) >= abs(obs) - eps for m in means) / k}


def permutation_p(x: list[float], y: list[float]) -> dict:
    """Exact two-sample permutation test of mean(``x``) - mean(``y``) = 0 (unpaired: seeds as
    exchangeable units): every split of the pooled values into groups of ``len(x)`` and ``len(y)``;
    ``less`` = share of splits whose difference is <= the observed one, ``greater`` >=, ``two_sided``
    |.| >= (3 vs 3 with every x below every y: 1/20 = 0.05 one-sided). Source: Good 2005, ch. 3.
    """
    import itertools

    pooled, nx = list(x) + list(y), len(x)
    if not x or not y:
        return {"less": None, "greater": None, "two_sided": None}
    obs, eps = statistics.mean(x) - statistics.mean(y), 1e-12
    diffs = []
    for idx in itertools.combinations(range(len(pooled)), nx):
        sel = set(idx)
        a = [pooled[i] for i in idx]
        b = [pooled[i] for i in range(len(pooled)) if i not in sel]
        diffs.append(statistics.mean(a) - statistics.mean(b))
    k = len(diffs)
    return {"less": sum(d <= obs + eps for d in diffs) / k, "greater": sum(d >= obs - eps for d in diffs) / k,
            "two_sided": sum(abs(d) >= abs(obs) - eps for d in diffs) / k}


def paired_outcome_diff(a: dict, b: dict) -> dict | None:
    """Paired (McNemar-style) difference of two greedy evals of the same prompts: ``a`` minus ``b``.

    Args:
        a, b: ``{"outcomes": "0110...", "ids": [...], "groups": [...] or None}`` (a cell's
            ``outcomes`` entry for one eval; aligned by ``ids``).
    Returns:
        ``{"diff", "se", "se_cluster", "n", "a_only", "b_only"}``: diff = (a_only - b_only) / n, se =
        sd of the per-prompt differences d_i in {-1, 0, 1} / sqrt(n) (= sqrt(a_only + b_only -
        (a_only - b_only)^2 / n) / sqrt(n (n - 1)); McNemar 1947, Miller 2024 "Adding Error Bars to
        Evals" sec. 4 on paired differences), ``se_cluster`` the same clustered by product
        (``trainer.evaluate.cluster_se``; None without groups); None when either side has no outcomes.
    Raises:
        ValueError: the two evals are not of the same prompts.
    """
    from megatron_rlhf.trainer.evaluate import cluster_se, mean_se

    if not a or not b or a.get("outcomes") is None or b.get("outcomes") is None:
        return None
    ia, ib = list(a.get("ids") or range(len(a["outcomes"]))), list(b.get("ids") or range(len(b["outcomes"])))
    if sorted(ia) != sorted(ib):
        raise ValueError("paired_outcome_diff: the two evals hold different prompts (ids differ)")
    ob = dict(zip(ib, b["outcomes"]))
    d = [float(x) - float(ob[i]) for i, x in zip(ia, a["outcomes"])]   # "0110..." chars or rewards
    n = len(d)
    diff, se = mean_se(d)
    groups = a.get("groups")
    return {"diff": diff, "se": se, "n": n, "a_only": sum(v > 0 for v in d), "b_only": sum(v < 0 for v in d),
            "se_cluster": cluster_se(d, groups) if groups else None}


def gain_diff(r1: dict, r2: dict) -> dict:
    """Gain of cell ``r1`` minus gain of cell ``r2`` with the right standard error.

    When both cells' greedy before-evals are the same (same base weights and prompts: bit-identical
    scores), the difference of gains is the difference of afters, so the shared before must not count:
    ``how = "paired"`` (both cells store per-prompt outcomes: :func:`paired_outcome_diff` of the
    afters), else ``"after-after"`` (se = hypot(after_se1, after_se2): unpaired, the afters treated as
    independent; conservative). Different befores: ``"gain-gain"`` (se = hypot(gain_se1, gain_se2)).
    Also ``z_double_counted`` = diff / hypot(gain_se1, gain_se2), the old verdicts' z, for comparison.
    """
    diff = r1["gain"] - r2["gain"]
    wrong = math.hypot(r1["gain_se"], r2["gain_se"])
    out = {"diff": diff, "z_double_counted": diff / wrong if wrong > 0 else None, "se_cluster": None}
    same_before = abs(r1["before"] - r2["before"]) < 1e-12
    o1, o2 = r1.get("outcomes") or {}, r2.get("outcomes") or {}
    paired = None
    if same_before and o1.get("after") is not None and o2.get("after") is not None:
        paired = paired_outcome_diff({"outcomes": o1["after"], "ids": o1.get("ids"), "groups": o1.get("groups")},
                                     {"outcomes": o2["after"], "ids": o2.get("ids"), "groups": o2.get("groups")})
    if paired is not None:
        out.update(how="paired", se=paired["se"], se_cluster=paired["se_cluster"],
                   discordant=(paired["a_only"], paired["b_only"]))
    elif same_before:
        out.update(how="after-after", se=math.hypot(r1["after_se"], r2["after_se"]))
    else:
        out.update(how="gain-gain", se=wrong)
    out["z"] = diff / out["se"] if out["se"] > 0 else None
    return out


# ----- table and plots ------------------------------------------------------------------------


def _f(x, fmt=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _ba(r: dict) -> str:
    o = r.get("outcomes") or {}
    cb = f" [cl. {o['before_se_cluster']:.3f}]" if o.get("before_se_cluster") is not None else ""
    ca = f" [cl. {o['after_se_cluster']:.3f}]" if o.get("after_se_cluster") is not None else ""
    return f"{r['before']:.3f} ± {r['before_se']:.3f}{cb} -> {r['after']:.3f} ± {r['after_se']:.3f}{ca}"


def _gain(r: dict) -> str:
    g = r.get("gain_paired")
    paired = f"; paired ± {g['se']:.3f}" if g else ""
    return f"{r['gain']:+.3f} ± {r['gain_se']:.3f} ({_f(r['z'], '.1f')}{paired})"


def _load(r: dict) -> str:
    ld = r["load"]
    return f"{ld['mean']:.1f} (max {ld['max']:.1f}, {ld['nproc']} cores)"


def async_vs_sync(results: dict[str, dict], seeds=SEEDS) -> dict:
    """Grid A's async - sync difference of gains, per seed and over seeds.

    Per seed with both A cells: ``diff`` = gain_async - gain_sync = after_async - after_sync (the
    greedy before is the same) with its se from :func:`gain_diff` (``how``: ``paired`` McNemar over
    prompts when both cells store per-prompt outcomes, else ``after-after``, the unpaired
    hypot(after_se_async, after_se_sync)), and ``wall_ratio`` = loop wall async / sync. Over those
    seeds: ``diff_mean`` ± ``diff_se`` = sd / sqrt(n) (one seed: its se over prompts),
    ``interval`` (:func:`t_interval`: the t multiplier, 95% interval, t and its two-sided p),
    ``sign_flip`` (:func:`sign_flip_p` of the per-seed differences), ``permutation``
    (:func:`permutation_p` of the afters, unpaired), and the mean wall ratio.
    """
    per = []
    for s in seeds:
        a, y = results.get(f"A_async_s{s}"), results.get(f"A_sync_s{s}")
        if a and y:
            g = gain_diff(a, y)
            per.append({"seed": s, "diff": g["diff"], "diff_se": g["se"], "how": g["how"], "z": g["z"],
                        "se_cluster": g["se_cluster"], "discordant": g.get("discordant"),
                        "after_async": a["after"], "after_sync": y["after"],
                        "wall_ratio": a["loop_wall_s"] / y["loop_wall_s"],
                        "load_mean": (a["load"]["mean"], y["load"]["mean"])})
    out = {"per_seed": per, "n": len(per)}
    if len(per) >= 2:
        d = [p["diff"] for p in per]
        out.update(diff_mean=statistics.mean(d), diff_se=statistics.stdev(d) / math.sqrt(len(d)),
                   wall_ratio_mean=statistics.mean(p["wall_ratio"] for p in per), interval=t_interval(d),
                   sign_flip=sign_flip_p(d),
                   permutation=permutation_p([p["after_async"] for p in per], [p["after_sync"] for p in per]))
    elif per:
        out.update(diff_mean=per[0]["diff"], diff_se=per[0]["diff_se"], wall_ratio_mean=per[0]["wall_ratio"])
    return out


def _over_seeds(diffs: list[float]) -> dict:
    """Mean of per-seed differences with its t-interval and exact sign-flip p (two seeds or more)."""
    return {"n": len(diffs), "interval": t_interval(diffs) if len(diffs) >= 2 else None,
            "sign_flip": sign_flip_p(diffs) if len(diffs) >= 2 else None,
            "mean": statistics.mean(diffs) if diffs else None}


def _outcomes_at(r: dict, step: int) -> dict | None:
    """A cell's per-prompt outcomes at its eval of ``step`` (its last, or an intermediate one), in the
    form :func:`paired_outcome_diff` takes; None when it has no eval there."""
    o = r.get("outcomes") or {}
    if o.get("after_step") == step:
        return {"outcomes": o["after"], "ids": o.get("ids"), "groups": o.get("groups")}
    for e in o.get("intermediate") or []:
        if e.get("step") == step:
            return {"outcomes": e["outcomes"], "ids": o.get("ids"), "groups": o.get("groups")}
    return None


def lag_matched(results: dict[str, dict], group: str = "L", seeds=LAG_SEEDS) -> dict:
    """Grid L (or L48): one-step async against sync, lag-matched and at the same step, per seed and
    over seeds.

    Sync trains N steps, async N + 1: async's last update is the first to use samples of the
    version that sync's last update used (async update k trains on pi_{k-2}'s samples, sync's on
    pi_{k-1}'s; Noukhovitch et al. 2024 sec. 3). Per seed with both cells:

    * ``matched``: async after N + 1 steps minus sync after N (the one-step data lag removed);
    * ``same_step``: async's eval at step N minus sync after N (what grid A compared);

    each a paired difference over the same prompts (:func:`paired_outcome_diff`: se of the per-prompt
    differences, and the cluster se by product), with ``wall_ratio`` = async's loop wall (N + 1
    steps) / sync's (N). Over seeds, for each: the mean, its t-interval and exact sign-flip p
    (:func:`_over_seeds`). ``curve``: per arm, the mean pass@1 over seeds at every eval step.
    """
    per = []
    for s in seeds:
        a, y = results.get(f"{group}_async_s{s}"), results.get(f"{group}_sync_s{s}")
        if not (a and y and a.get("outcomes") and y.get("outcomes")):
            continue
        n_sync = y["outcomes"]["after_step"]
        sync_after = _outcomes_at(y, n_sync)
        row = {"seed": s, "steps": (n_sync, a["outcomes"]["after_step"]),
               "wall_ratio": a["loop_wall_s"] / y["loop_wall_s"],
               "load_mean": (a["load"]["mean"], y["load"]["mean"])}
        for key, step in (("matched", a["outcomes"]["after_step"]), ("same_step", n_sync)):
            at = _outcomes_at(a, step)
            row[key] = paired_outcome_diff(at, sync_after) if at else None
        per.append(row)
    out = {"group": group, "per_seed": per}
    for key in ("matched", "same_step"):
        out[key] = _over_seeds([p[key]["diff"] for p in per if p[key]])
    out["wall_ratio_mean"] = statistics.mean(p["wall_ratio"] for p in per) if per else None
    curve: dict[str, dict[int, list[float]]] = {"sync": {}, "async": {}}
    for s in seeds:
        for arm in ("sync", "async"):
            for c in (results.get(f"{group}_{arm}_s{s}") or {}).get("curve") or []:
                curve[arm].setdefault(c["step"], []).append(c["value"])
    out["curve"] = {arm: {st: statistics.mean(v) for st, v in sorted(d.items())} for arm, d in curve.items()}
    out["curve_n"] = {arm: {st: len(v) for st, v in sorted(d.items())} for arm, d in curve.items()}
    return out


def comparisons(results: dict[str, dict], cells: list[Cell], group: str) -> list[dict]:
    """Every cell of ``group`` against each cell it names in ``vs`` (grid B: N > 1 against N = 1 and
    the on-policy point, TIS off against TIS; grid C: N > 1 against N = 1 of the same loss and seed),
    by :func:`gain_diff`, in grid order; pairs with a missing cell are left out."""
    def res(name):
        c = next((x for x in cells if x.name == name), None)
        return results.get(c.alias or c.name) if c else results.get(name)

    out = []
    for c in cells:
        if c.group != group:
            continue
        for base in c.vs:
            r, r0 = res(c.name), res(base)
            if r and r0:
                g = gain_diff(r, r0)
                n = len((r.get("outcomes") or {}).get("after") or "") or _n_prompts(r)
                out.append({"cell": c.name, "base": base, "loss": c.loss, "n": c.n,
                            "prompts": round(g["diff"] * n) if n else None, **g})
    return out


def _n_prompts(r: dict) -> int | None:
    """Prompts of a cell's eval: from its stored outcomes, else from before = k / n with se (the
    Bernoulli se^2 = p (1 - p) / (n - 1) solved for n); None when neither gives it."""
    p, se = r.get("before"), r.get("before_se")
    if p is None or not se or not 0 < p < 1:
        return None
    return round(p * (1 - p) / (se * se)) + 1


def write_tables(out: Path, results: dict[str, dict], cells: list[Cell], pilot_lrs, *, dry_run: bool,
                 steps: int, pilot_steps: int) -> str:
    """Write ``out/results.md``, ``out/gain_vs_N.png`` and ``out/gain_vs_wall.png`` from the finished
    cells; returns the Markdown. Missing cells are listed with the command that runs them."""
    def res(c: Cell):
        return results.get(c.alias) if c.alias else results.get(c.name)

    model = "tiny random Llama, synthetic reward (DRY RUN: the harness, not a result)" if dry_run else \
        "SmolLM2-135M-Instruct, single-digit multiplication, math-verify"
    lines = [f"# Async and off-policyness on a real model ({model})", "",
             f"`bench/seeds_repro.py` (issue 22); recipe `configs/repro_math.yaml`; {steps} steps per grid run, "
             f"{pilot_steps} per pilot. Held-out: greedy pass@1 on the demo's 128 eval rows, before step 1 "
             "and after the last; ± = standard error over prompts; (z) = gain / sqrt(se_before² + se_after²) "
             "(conservative: the two evals are of the same prompts). KL = mean `kl/ref_k1` over the last 4 steps "
             "(nats per completion token, the batch's own samples). Load = 1-minute load average during the "
             "run: **wall times and their ratios measured under load are not the paper's comparison** "
             "(quality numbers are: the handshake bounds staleness at any speed).", ""]
    pv = provenance(out)
    lines += [f"Table written {pv['utc'][:10]} at commit {pv['commit']}"
              + (" + uncommitted changes" if pv["dirty"] else "") + f" on {_machine()}, from the cell files; "
              "each cell's code is in its JSON (`started`: commit and dirty flag at its start, newer cells "
              "only; `commit`: at its end).", ""]
    stored = [n for n, r in results.items() if r.get("outcomes")]
    lines += [f"Per-prompt outcomes: stored in {len(stored)} of {len(results)} cell files"
              + (f" ({' '.join(sorted(stored))})" if stored else "") + ". "
              + ("The cells without them ran before `trainer/evaluate.py` kept them, on the *old* held-out "
                 "split (32 ordered products; 17 of its 28 unordered products are trained on in the commuted "
                 "order): their differences below use the unpaired after-after se, and no cluster-robust se "
                 "exists for them. Cells with outcomes ran on the unordered split (no eval product trained in "
                 "either order) and get paired (McNemar) differences and a by-product cluster se [cl.]."
                 if len(stored) < len(results) else
                 "Differences are paired over prompts (McNemar); [cl.] = cluster-robust se by product."), ""]
    a_cells = [c for c in cells if c.group == "A"]
    lines += ["## A. Sync vs one-step async Online DPO (Noukhovitch et al. 2024, Tables 1-2)", "",
              "| cell | seed | mode | pass@1 before -> after | gain ± se (z) | mean@k before -> after | KL k1 | "
              "staleness mean | loop wall (min) | load avg | KL fresh after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in a_cells:
        r = res(c)
        if r:
            mk = r.get("mean@k") or {}
            lines.append(f"| {c.name} | {c.seed} | {'sync' if c.sync else 'async N=1'} | {_ba(r)} | {_gain(r)} | "
                         f"{_f(mk.get('before'))} -> {_f(mk.get('after'))} | {_f(r['kl_k1'], '.4f')} | "
                         f"{_f(r['staleness_mean'], '.2f')} | {r['loop_wall_s'] / 60:.1f} | {_load(r)} | {_kl(r)} |")
    avs = async_vs_sync(results)
    lines.append("")
    for p in avs["per_seed"]:
        how = {"paired": "paired over prompts (McNemar), discordant {}/{}".format(*(p["discordant"] or (0, 0))),
               "after-after": "unpaired after-after se: no per-prompt outcomes stored",
               "gain-gain": "different befores: hypot of the gain ses"}[p["how"]]
        cl = f" [cl. ± {p['se_cluster']:.3f}]" if p.get("se_cluster") is not None else ""
        lines.append(f"- seed {p['seed']}: gain async - sync = {p['diff']:+.3f} ± {p['diff_se']:.3f}{cl} "
                     f"(z {_f(p['z'], '.2f')}; {how}); loop wall async / sync = {p['wall_ratio']:.2f} "
                     f"(load {p['load_mean'][0]:.1f} / {p['load_mean'][1]:.1f})")
    if avs["n"]:
        how = "std/sqrt(n) over seeds" if avs["n"] >= 2 else "se over prompts, one seed"
        lines.append(f"- **{avs['n']} seed(s): gain async - sync = {avs['diff_mean']:+.3f} ± {avs['diff_se']:.3f} "
                     f"({how}); wall async / sync = {avs['wall_ratio_mean']:.2f}** (under the load shown)")
    if avs.get("interval"):
        iv, sf, pm = avs["interval"], avs["sign_flip"], avs["permutation"]
        below = sum(p["diff"] < 0 for p in avs["per_seed"])
        lines.append(f"- across seeds: {iv['level']:.0%} t-interval [{iv['lo']:+.3f}, {iv['hi']:+.3f}] (mean ± "
                     f"t_{{0.975, {iv['n'] - 1}}} = {iv['t_mult']:.2f} × se), t = {iv['t']:.2f}, two-sided p = "
                     f"{iv['p_two_sided']:.3f}; exact sign-flip p ({below} of {iv['n']} seeds below 0; "
                     f"{2 ** iv['n']} sign patterns): one-sided {sf['less']:.3f}, two-sided {sf['two_sided']:.3f}; "
                     f"exact permutation p of the afters, unpaired ({math.comb(2 * iv['n'], iv['n'])} splits): "
                     f"one-sided {pm['less']:.3f}, two-sided {pm['two_sided']:.3f}")
    lines.append("")
    for group in ("L", "L48"):
        lines += _lag_lines(results, [c for c in cells if c.group == group], group)
    lines += [f"## Pilot: lr per policy-gradient loss at N = 1 ({pilot_steps} steps, seed 0)", "",
              "Scored on a validation slice of the *training* rows (64 rows, sha256 order, taken out of "
              "training), never on the test rows. Choice: the largest validation pass@1 gain (ties: smaller lr).",
              "", "| loss | lr | validation pass@1 before -> after | gain ± se (z) | KL k1 | loop wall (min) | "
              "load avg | chosen |", "|---|---|---|---|---|---|---|---|"]
    for loss in dict.fromkeys(c.loss for c in cells if c.pilot):
        choice, found = pilot_choice(results, loss, pilot_lrs)
        for r in found:
            lines.append(f"| {loss} | {r['lr']:g} | {_ba(r)} | {_gain(r)} | {_f(r['kl_k1'], '.4f')} | "
                         f"{r['loop_wall_s'] / 60:.1f} | {_load(r)} | {'**yes**' if r['lr'] == choice else ''} |")
    lines += ["", "## B. Off-policyness N = sync_interval = max_staleness (Noukhovitch Fig. 3-4; "
              "Lanchantin Table 1)", "",
              "| loss | N | lr | pass@1 before -> after | gain ± se (z) | KL k1 | staleness mean | "
              "token_mult_prob_error | TIS weight mean | TIS capped frac | loop wall (min) | load avg | KL fresh after |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        r = res(c) if c.group == "B" else None
        if r:
            lines.append(f"| {c.loss} | {_mode(c)} | {r['lr']:g} | {_ba(r)} | {_gain(r)} | {_f(r['kl_k1'], '.4f')} | "
                         f"{_f(r['staleness_mean'], '.2f')} | {_f(r['token_mult_prob_error_mean'], '.4f')} | "
                         f"{_f(r['tis_weight_mean'], '.4f')} | {_f(r['tis_capped_frac'], '.4f')} | "
                         f"{r['loop_wall_s'] / 60:.1f} | {_load(r)} | {_kl(r)} |")
    lines += _comparison_lines(comparisons(results, cells, "B"),
                               "Each cell against the cells it is compared with (seed 0): N > 1 against N = 1 "
                               "and the on-policy point of the same loss, TIS off against TIS at N = 16. Cells on the "
                               "same held-out split share their greedy before, so a difference of gains is a "
                               "difference of afters: se = hypot(after_se, after_se) (unpaired; paired McNemar when "
                               "both cells store outcomes). `gain-gain` rows compare a cell of the old split "
                               "(before 0.609) with one of the split that does not leak (before 0.547): gains on "
                               "different prompts, indicative only. The last column is the z the earlier verdicts used, hypot(gain_se, "
                               "gain_se): it counts the shared before twice. No B se includes run-to-run variance "
                               "(one seed; grid A's seed sd of a DPO gain is 0.005-0.016).")
    lines += ["", "## C. The papers' N: sync_interval = N, max_staleness = N - 1 (Noukhovitch Fig. 3-4)", "",
              "Staleness 0..N-1 (N = 1 on-policy), carried surplus off; PPO and Proximal RLOO with T = 2 "
              "updates per batch (the clip acts) and the KL penalty beta = 0.05 in the reward; lr per loss "
              "from its pilot. Evals every max(8, N) steps; KL fresh = KL(policy || reference) per token on "
              "the eval's own samples of the evaluated weights (`eval/math/kl_ref`, k3), the frontier's "
              "x-axis (`frontier.png`).", "",
              "| loss | N | seed | lr | pass@1 before -> after | gain ± se (z) | KL fresh after (nats/token) | "
              "staleness mean | token_mult_prob_error | loop wall (min) | load avg |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        r = res(c) if c.group in ("C", "Cseeds") else None
        if r:
            lines.append(f"| {c.loss} | {c.n} | {c.seed} | {r['lr']:g} | {_ba(r)} | {_gain(r)} | {_kl(r)} | "
                         f"{_f(r['staleness_mean'], '.2f')} | {_f(r['token_mult_prob_error_mean'], '.4f')} | "
                         f"{r['loop_wall_s'] / 60:.1f} | {_load(r)} |")
    lines += _comparison_lines(comparisons(results, cells, "C") + comparisons(results, cells, "Cseeds"),
                               "Each N against N = 1 (on-policy) of the same loss and seed.")
    missing = [c.name for c in cells if res(c) is None and c.group not in OPTIONAL_GROUPS]
    optional = [c.name for c in cells if res(c) is None and c.group in OPTIONAL_GROUPS]
    lines += ["", "## Not run yet", ""]
    if missing:
        lines += [f"{len(missing)} cell(s): {' '.join(missing)}", "",
                  "    nice -n 15 python bench/seeds_repro.py --only " + " ".join(missing), ""]
    else:
        lines += ["none of grids A, P, B, C: every cell is finished", ""]
    if optional:
        lines += [f"Optional (seeds 1-2 of grid C, if the time allows): {' '.join(optional)} (`--only Cseeds`)"]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    _plot(out, results, cells)
    return text


def _lag_lines(results: dict[str, dict], cells: list[Cell], group: str) -> list[str]:
    """Grid L's (or L48's) section of ``results.md``: its cells, the per-seed and across-seed
    differences of :func:`lag_matched` and the mean learning curves (nothing when no cell ran)."""
    done = [c for c in cells if results.get(c.name)]
    if not done:
        return []
    n = next((c.steps for c in cells if c.steps), None)
    title = (f"## {group}. Lag-matched: sync {n or 16} steps vs one-step async {(n or 16) + 1} steps "
             "(issue 34, item 6; Noukhovitch et al. 2024 Tables 1-2)")
    lines = [title, "", "Online DPO, lr 3e-6, the unordered held-out split (no eval product trained in either "
             "order). Async's last update is the first to use samples of the version sync's last update "
             "used, so **matched** = async after N + 1 minus sync after N removes the one-step data lag; "
             "**same step** = async at step N minus sync at N (what grid A compared). Differences are paired "
             "over the same prompts (McNemar se; [cl.] clustered by product); across seeds: mean, 95% "
             "t-interval, exact sign-flip p.", "",
             "| cell | seed | steps | pass@1 before -> after | gain ± se (z) | KL fresh after | loop wall (min) | load avg |",
             "|---|---|---|---|---|---|---|---|"]
    for c in done:
        r = results[c.name]
        lines.append(f"| {c.name} | {c.seed} | {r['steps']} | {_ba(r)} | {_gain(r)} | {_kl(r)} | "
                     f"{r['loop_wall_s'] / 60:.1f} | {_load(r)} |")
    lm = lag_matched(results, group, sorted({c.seed for c in cells}))
    lines.append("")
    for p in lm["per_seed"]:
        parts = []
        for key, name in (("matched", "matched"), ("same_step", "same step")):
            g = p[key]
            if g:
                cl = f" [cl. {g['se_cluster']:.3f}]" if g.get("se_cluster") is not None else ""
                parts.append(f"{name} {g['diff']:+.3f} ± {g['se']:.3f}{cl} (async-only {g['a_only']}, "
                             f"sync-only {g['b_only']})")
        lines.append(f"- seed {p['seed']} (sync {p['steps'][0]} / async {p['steps'][1]} steps): "
                     + "; ".join(parts) + f"; loop wall async / sync {p['wall_ratio']:.2f} "
                     f"(load {p['load_mean'][0]:.1f} / {p['load_mean'][1]:.1f})")
    for key, name in (("matched", "matched (async N + 1 - sync N)"), ("same_step", "same step (async N - sync N)")):
        o = lm[key]
        if o["interval"]:
            iv, sf = o["interval"], o["sign_flip"]
            lines.append(f"- **{o['n']} seeds, {name}: {iv['mean']:+.3f}, 95% t-interval [{iv['lo']:+.3f}, "
                         f"{iv['hi']:+.3f}]**, t = {iv['t']:.2f}, two-sided p = {iv['p_two_sided']:.3f}; exact "
                         f"sign-flip p two-sided {sf['two_sided']:.3f}")
        elif o["n"]:
            lines.append(f"- 1 seed, {name}: {o['mean']:+.3f} (no interval across seeds yet)")
    if lm["wall_ratio_mean"] is not None:
        lines.append(f"- loop wall async (N + 1 steps) / sync (N steps), mean over seeds: {lm['wall_ratio_mean']:.2f}")
    steps = sorted(set(lm["curve"]["sync"]) | set(lm["curve"]["async"]))
    if steps:
        lines += ["", "Mean held-out pass@1 over seeds at each eval step (seeds in brackets):", "",
                  "| arm | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---|" * len(steps)]
        for arm in ("sync", "async"):
            cv, cn = lm["curve"][arm], lm["curve_n"][arm]
            lines.append(f"| {arm} | " + " | ".join(f"{cv[st]:.3f} ({cn[st]})" if st in cv else "–"
                                                    for st in steps) + " |")
    return lines + [""]


def _mode(c: Cell) -> str:
    """Grid B's N column: ``4``, ``on-policy``, ``16, TIS off``."""
    if c.sync:
        return "on-policy"
    return f"{c.n}, TIS off" if "algorithm.is_correction=none" in c.extra else str(c.n)


def _kl(r: dict) -> str:
    """KL to the reference on the after-eval's fresh samples, ``0.0123 ± 0.0010`` (``–`` without)."""
    k = r.get("kl_ref") or {}
    if k.get("after") is None:
        return "–"
    return f"{k['after']:.4f}" + (f" ± {k['after_se']:.4f}" if k.get("after_se") is not None else "")


def _comparison_lines(comps: list[dict], intro: str) -> list[str]:
    """The table of :func:`comparisons` (nothing when empty)."""
    if not comps:
        return []
    lines = ["", intro, "", "| cell | minus | diff of gains (prompts) | se | how | z | z (old, before counted twice) |",
             "|---|---|---|---|---|---|---|"]
    for g in comps:
        cl = f" [cl. {g['se_cluster']:.3f}]" if g.get("se_cluster") is not None else ""
        lines.append(f"| {g['cell']} | {g['base']} | {g['diff']:+.3f} ({_f(g['prompts'], '+d')}) | "
                     f"{g['se']:.3f}{cl} | {g['how']} | {_f(g['z'], '+.2f')} | {_f(g['z_double_counted'], '+.2f')} |")
    return lines


def _machine() -> str:
    """``"2-core AMD EPYC ..."``: this machine's core count and CPU model (``/proc/cpuinfo``)."""
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{os.cpu_count()}-core {model}".strip()


def _plot(out: Path, results: dict[str, dict], cells: list[Cell]) -> None:
    """``gain_vs_N.png``, ``gain_vs_wall.png`` and ``frontier.png`` (``bench/seeds_repro_plots.py``)."""
    plots.gain_vs_n(out / "gain_vs_N.png", results, cells, N_VALUES)
    plots.gain_vs_wall(out / "gain_vs_wall.png", results, cells)
    plots.frontier(out / "frontier.png", results, cells)


# ----- running --------------------------------------------------------------------------------


class LoadSampler:
    """The 1-minute load average every ``period`` seconds in a thread: start, end, mean, max."""

    def __init__(self, period: float = 15.0):
        self.period, self.samples, self._stop = period, [os.getloadavg()[0]], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=1)
        self.samples.append(os.getloadavg()[0])
        s = self.samples
        return {"start": s[0], "end": s[-1], "mean": sum(s) / len(s), "max": max(s), "samples": len(s),
                "nproc": os.cpu_count()}


def wait_for_memory(gib: float, poll_s: float = 30.0) -> None:
    """Block until ``MemAvailable`` is at least ``gib`` GiB (a SmolLM2 run holds ~11 GB; the machine
    is shared), printing the wait once."""
    def avail():
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
        return float("inf")

    t0, told = time.perf_counter(), False
    while (a := avail()) < gib:
        if not told:
            print(f"[seeds_repro] waiting for {gib:g} GiB of free memory ({a:.1f} now)", flush=True)
            told = True
        time.sleep(poll_s)
    if told:
        print(f"[seeds_repro] waited {time.perf_counter() - t0:.0f} s for memory", flush=True)


def run_cell(cell: Cell, lr: float, args, model_dir: str, gen) -> dict:
    """Train ``cell`` from step 0 (its run folder is removed first) and write its JSON."""
    from megatron_rlhf.trainer.loop import train

    started = provenance(args.out)   # before anything runs: the code of this cell
    cfg, ov = load(args, cell, lr, model_dir)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    print(f"[seeds_repro] {cell.name}: {cell.loss}, {'sync' if cell.sync else f'N={cell.n}'}, "
          f"seed {cell.seed}, lr {lr:g}, {cfg.run.num_steps} steps ...", flush=True)
    sampler, t0 = LoadSampler(), time.perf_counter()
    summary = train(cfg, quiet=True, generators=[gen])
    call_wall = time.perf_counter() - t0
    load_avg = sampler.stop()
    if summary.get("stopped_early"):
        raise RuntimeError(f"{cell.name}: the run stopped early (signal); not recorded")
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    res = cell_result(cell, lr, ov, summary, rows, load_avg, call_wall, started)
    path = args.out / f"{cell.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(path)     # a half-written JSON never counts as finished
    print(f"[seeds_repro] {cell.name}: {res['metric']} {res['before']:.3f} -> {res['after']:.3f} "
          f"(gain {res['gain']:+.3f} ± {res['gain_se']:.3f}), KL {res['kl_k1']}, KL fresh "
          f"{(res['kl_ref'] or {}).get('after')}, staleness "
          f"{res['staleness_mean']:.2f}; loop wall {res['loop_wall_s']:.0f} s, run {call_wall:.0f} s, "
          f"load avg {load_avg['mean']:.1f} (max {load_avg['max']:.1f}) on {load_avg['nproc']} cores",
          flush=True)
    return res


def main(argv: list[str] | None = None, *, generator=None, model_dir: str | None = None) -> int:
    """Run the selected cells that are not finished yet, then write the table and plots.

    ``generator`` / ``model_dir``: an already started ``VLLMGenerator`` actor of the HF folder
    ``model_dir`` in a Ray cluster this process joined (tests share theirs); None starts both.
    """
    class Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Fmt)
    ap.add_argument("--only", nargs="+", default=None,
                    help="groups (A, B, P, L, L48, C, Cseeds) or cell names, space- or comma-separated "
                         "(default: all but Cseeds)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny random Llama, synthetic reward, 2 steps per cell (CI: the harness end to end)")
    ap.add_argument("--steps", type=int, default=None, help="learner steps per grid run (16; dry run 2)")
    ap.add_argument("--pilot-steps", type=int, default=None, help="steps per pilot run (8; dry run 2)")
    ap.add_argument("--pilot-lrs", default=",".join(f"{x:g}" for x in PILOT_LRS), help="pilot lr grid")
    ap.add_argument("--pilot-eval-prompts", type=int, default=None, help="validation rows of a pilot (64; dry run 8)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (bench/results/seeds_repro; dry run: runs/seeds_repro_dry)")
    ap.add_argument("--min-free-gib", type=float, default=None,
                    help="wait for this much available memory before each run (7; dry run 0)")
    ap.add_argument("--eval-samples", type=int, default=EVAL_SAMPLES,
                    help="sampled completions per eval prompt (mean@k and the KL on fresh samples; 0: greedy only)")
    ap.add_argument("--table", action="store_true", help="only rewrite results.md and the plots")
    ap.add_argument("--list", action="store_true",
                    help="print every cell (the optional groups too), its group and whether it is finished")
    ap.add_argument("override", nargs="*", help="extra key=value config overrides for every run")
    args = ap.parse_args(argv)
    args.only = [x for o in (args.only or []) for x in o.split(",") if x] or None
    pilot_lrs = tuple(float(x) for x in args.pilot_lrs.split(",") if x)
    if args.steps is None:
        args.steps = 2 if args.dry_run else 16
    if args.pilot_steps is None:
        args.pilot_steps = 2 if args.dry_run else 8
    if args.pilot_eval_prompts is None:
        args.pilot_eval_prompts = 8 if args.dry_run else 64
    if args.min_free_gib is None:
        args.min_free_gib = 0.0 if args.dry_run else 7.0
    if args.out is None:
        args.out = REPO / ("runs/seeds_repro_dry" if args.dry_run else "bench/results/seeds_repro")
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs = (Path(tempfile.mkdtemp(prefix="seeds-repro-")) if args.dry_run
                 else REPO / "runs" / "seeds_repro")   # runs/ is git-ignored
    cells = grid(pilot_lrs)
    todo = select(cells, args.only)
    results = read_results(args.out)
    if args.list:
        for c in (todo if args.only else cells):
            state = "done" if c.name in results or c.alias in results else "defined, not run"
            print(f"{c.name:28} {c.group:7} {state}" + (" (optional)" if c.group in OPTIONAL_GROUPS else ""))
        return 0
    if not args.table:
        run_cells(args, cells, todo, results, pilot_lrs, generator=generator, model_dir=model_dir)
    text = write_tables(args.out, read_results(args.out), cells, pilot_lrs, dry_run=args.dry_run,
                        steps=args.steps, pilot_steps=args.pilot_steps)
    print(text)
    return 0


def run_cells(args, cells: list[Cell], todo: list[Cell], results: dict, pilot_lrs, *, generator=None,
              model_dir: str | None = None) -> None:
    """Run every cell of ``todo`` not finished yet (a B cell's missing pilots first), on
    ``generator`` when given (see :func:`main`), else on a Ray cluster and generator started here."""
    plan: list[Cell] = []
    for c in todo:
        if c.alias or c.name in results:
            continue
        if c.lr is None:   # the pilot first
            plan += [p for p in cells if p.pilot and p.loss == c.loss and p.name not in results and p not in plan]
        if c not in plan:
            plan.append(c)
    if not plan:
        print("[seeds_repro] every selected cell is finished", flush=True)
        return
    print(f"[seeds_repro] {len(plan)} run(s) to do: {' '.join(c.name for c in plan)}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    from megatron_rlhf.runtime import apply_process_env, process_env
    from megatron_rlhf.trainer.setup import build_generators, resolve_model_dir

    apply_process_env()
    own = generator is None
    if own and args.dry_run:
        from megatron_rlhf.testing.tiny import make_tiny_model

        model_dir = str(make_tiny_model(Path(args.runs) / "tiny_model", "llama"))
    elif own:
        from megatron_rlhf.config import load_config

        model_dir = str(resolve_model_dir(load_config(RECIPE, []).model))   # converts SmolLM2 on first use
    if own:
        ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": process_env()},
                 logging_level="WARNING")
    t_all = time.perf_counter()
    try:
        gen = generator
        if own:
            base, _ = load(args, plan[0], DPO_LR, model_dir)
            gen = build_generators(base, Path(model_dir))[0]
            ray.get(gen.__ray_ready__.remote(), timeout=900)
        for c in plan:
            lr = c.lr
            if lr is None:
                lr, _ = pilot_choice(read_results(args.out), c.loss, pilot_lrs)
                print(f"[seeds_repro] {c.loss}: lr {lr:g} chosen by its pilot", flush=True)
            wait_for_memory(args.min_free_gib)
            results[c.name] = run_cell(c, lr, args, model_dir, gen)
            if not args.dry_run:   # the table after every run of a long grid (the dry run: at its end)
                write_tables(args.out, read_results(args.out), cells, pilot_lrs, dry_run=args.dry_run,
                             steps=args.steps, pilot_steps=args.pilot_steps)
        if own:
            ray.kill(gen)
    finally:
        if own:
            ray.shutdown()
        if args.dry_run:
            shutil.rmtree(args.runs, ignore_errors=True)
    print(f"[seeds_repro] {len(plan)} run(s) in {time.perf_counter() - t_all:.0f} s", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
