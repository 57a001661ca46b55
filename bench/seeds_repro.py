"""The two papers' findings on a real model: sync vs one-step async, and which losses survive staleness.

Issue 22. SmolLM2-135M-Instruct (``model.source: smollm2``) on the demo's math task alone
(``configs/repro_math.yaml``: single-digit multiplication, math-verify, the demo's 128 held-out
rows; no chat task, no reward model). Every run is evaluated (greedy pass@1 and mean@2 on the
held-out rows) before step 1 and after its last step (``trainer/evaluate.py``).

* **Grid A** (Noukhovitch et al. 2024, "Asynchronous RLHF", Tables 1-2): Online DPO, synchronous
  (``async.sync=true``) vs one-step asynchronous (``max_staleness = 1``), seeds 0, 1, 2; cells
  ``A_sync_s<S>``, ``A_async_s<S>``.
* **Grid B** (Noukhovitch et al. 2024 Fig. 3-4; Lanchantin et al. 2025 Table 1):
  ``async.sync_interval = async.max_staleness = N`` in {1, 4, 16} for online_dpo, grpo and rloo,
  seed 0; cells ``B_<loss>_N<N>``. N = 16 with 16 steps: the generator never receives new weights
  (Lanchantin's offline end). ``B_online_dpo_N1`` *is* ``A_async_s0`` (same config): read, not re-run.
  PPO (with its critic) is defined too (``--only ppo``), not part of ``B`` by default.
* **Pilot** (cells ``P_<loss>_lr<lr>``): each policy-gradient loss's learning rate is chosen by a
  short run at N = 1 (``--pilot-steps`` steps, one-step async, seed 0) per lr of ``--pilot-lrs``,
  scored on a *validation* slice of the training prompts (the task's ``eval_data`` dropped, so the
  evaluator holds out 64 training rows, sha256 order) and never on the held-out test rows. The
  choice: the lr with the largest validation pass@1 gain (ties: the smaller lr); then fixed across
  N, as the paper does. Online DPO keeps the demo's lr (3e-6, which learned in 3 of 3 seeds:
  bench/RESULTS.md). A B cell runs its loss's missing pilot cells first.

    nice -n 15 python bench/seeds_repro.py                  # everything, A seed 0 first; resumable
    nice -n 15 python bench/seeds_repro.py --only A         # grid A (or B, P, ppo, or cell names)
    python bench/seeds_repro.py --table                     # only rewrite results.md and the plots
    python bench/seeds_repro.py --dry-run --out /tmp/x      # tiny random model, 2 steps per cell

Resumable: each finished run writes ``OUT/<cell>.json``; a re-run skips every cell whose JSON
exists (an interrupted cell starts again from step 0: ``checkpoint.interval: 0``). Per cell the
JSON holds the config overrides, the eval before/after with standard errors, the gain and its
z-score (computed as in ``bench/demo_seeds.py``), KL to the reference (``kl/ref_k1``/``k3``: mean
over the last 4 steps, the batch's own samples), the staleness, the loop's wall time
(``summary.json`` ``wall_s``: setup excluded), the 1-minute load average sampled every 15 s during
the run, and per step every ``logprobs/*``, ``tis/*``, ``staleness/*``, ``kl/*``, reward and time
key of ``metrics.jsonl`` (so the mismatch paid for staleness sits next to quality). After each run
it rewrites ``OUT/results.md`` and the plots ``gain_vs_N.png`` and ``gain_vs_wall.png``.

One Ray cluster and one vLLM generator (``setup.build_generators`` of the first cell's config,
reset to the base weights at each run's start and reseeded per batch, so results do not depend on
the order the cells run in) serve every cell of an invocation, as ``bench/offpolicy_sweep.py``
(which this replaces) did.

Statistics. Gain = after - before of held-out greedy pass@1; z = gain / sqrt(se_b^2 + se_a^2)
(``demo_seeds.seed_row``; the evals treated as independent: conservative). Async - sync per seed:
the greedy "before" is identical (same base weights, greedy decoding), so the difference of gains
is after_async - after_sync with se = sqrt(se_async^2 + se_sync^2) over prompts; over seeds, the
mean of the per-seed differences with std/sqrt(n_seeds). Wall times measured under load (the
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

RECIPE = REPO / "configs" / "repro_math.yaml"
DPO_LR = 3.0e-6            # cpu_demo.yaml's lr: learned in 3 of 3 seeds (bench/RESULTS.md)
PILOT_LRS = (1.0e-6, 3.0e-6, 1.0e-5)
N_VALUES = (1, 4, 16)
B_LOSSES = ("online_dpo", "grpo", "rloo")
SEEDS = (0, 1, 2)
TAIL = 4                   # KL = mean over the last TAIL steps
PER_STEP_PREFIXES = ("logprobs/", "tis/", "staleness/", "kl/", "reward/mean", "time/", "pairs/count",
                     "loss/total", "pg/", "entropy/")
# Policy-gradient losses train every completion of a group: 4 prompts x K=4 = 16 sequences a step,
# as many as Online DPO's 6 pairs x 2 + a margin; Online DPO keeps the demo's K = 8 (pairs of best
# vs worst of 8).
PG_SHAPE = ["algorithm.samples_per_prompt=4", "algorithm.prompts_per_step=4"]
DRY_TASK = {"name": "math", "reward": "megatron_rlhf.rewards.synthetic:letter_rate", "instruction": "",
            "data": {"path": "data/arithmetic/mul1.jsonl", "prompt_field": "input", "answer_field": "target"},
            "eval_data": {"path": "data/arithmetic/mul1_eval.jsonl", "prompt_field": "input",
                          "answer_field": "target"}}


@dataclass
class Cell:
    """One run of the grid: its name, group (A, P, B, ppo) and what it sets."""

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


def lr_tag(lr: float) -> str:
    """``1e-06`` -> ``1e-6`` (cell names)."""
    m, e = f"{lr:.0e}".split("e")
    return f"{m}e{int(e)}"


def grid(pilot_lrs=PILOT_LRS) -> list[Cell]:
    """Every cell, in the order ``python bench/seeds_repro.py`` runs them (A seed 0 first, then the
    pilots, then B, then A seeds 1-2, then PPO)."""
    def a(seed):
        return [Cell(f"A_sync_s{seed}", "A", "online_dpo", sync=True, seed=seed, lr=DPO_LR),
                Cell(f"A_async_s{seed}", "A", "online_dpo", n=1, seed=seed, lr=DPO_LR)]

    def pilots(loss):
        return [Cell(f"P_{loss}_lr{lr_tag(lr)}", "ppo" if loss == "ppo" else "P", loss, lr=lr, pilot=True,
                     extra=list(PG_SHAPE)) for lr in pilot_lrs]

    def b(loss, group="B"):
        out = []
        for n in N_VALUES:
            if loss == "online_dpo":
                out.append(Cell(f"B_{loss}_N{n}", group, loss, n=n, lr=DPO_LR,
                                alias="A_async_s0" if n == 1 else None))
            else:
                out.append(Cell(f"B_{loss}_N{n}", group, loss, n=n, extra=list(PG_SHAPE)))
        return out

    cells = a(0) + pilots("grpo") + pilots("rloo")
    for loss in B_LOSSES:
        cells += b(loss)
    cells += a(1) + a(2) + pilots("ppo") + b("ppo", "ppo")
    return cells


def select(cells: list[Cell], only: list[str] | None) -> list[Cell]:
    """The cells ``--only`` names (groups A, B, P, ppo or cell names), in grid order.

    Raises:
        SystemExit: a name that is neither a group nor a cell (the valid names listed).
    """
    if not only:
        return [c for c in cells if c.group != "ppo"]
    names = {c.name for c in cells}
    groups = {c.group for c in cells}
    bad = [x for x in only if x not in names and x not in groups]
    if bad:
        raise SystemExit(f"--only: unknown {bad}; groups {sorted(groups)}, cells {[c.name for c in cells]}")
    return [c for c in cells if c.name in only or c.group in only]


# ----- configs --------------------------------------------------------------------------------


def overrides(cell: Cell, lr: float, args, model_dir: str) -> list[str]:
    """The ``key=value`` overrides of ``cell`` over the recipe (stored in the run's JSON)."""
    steps = args.steps if not cell.pilot else args.pilot_steps
    out = [f"model.source={model_dir}", f"run.output_dir={args.runs}", f"run.name={cell.name}",
           f"run.num_steps={steps}", f"run.seed={cell.seed}", f"algorithm.loss={cell.loss}",
           f"learner.optimizer.lr={lr}", "checkpoint.resume=false", "logging.progress=false",
           "logging.tensorboard=false"]
    out += (["async.sync=true", "async.max_staleness=1", "async.sync_interval=1"] if cell.sync else
            ["async.sync=false", f"async.max_staleness={cell.n}", f"async.sync_interval={cell.n}"])
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


def cell_result(cell: Cell, lr: float, ov: list[str], summary: dict, rows: list[dict], load_avg: dict,
                call_wall_s: float) -> dict:
    """The JSON of one finished cell (see the module docstring) from the run's summary and rows."""
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
        "per_step": per_step,
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit(),
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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


# ----- table and plots ------------------------------------------------------------------------


def _f(x, fmt=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _ba(r: dict) -> str:
    return f"{r['before']:.3f} ± {r['before_se']:.3f} -> {r['after']:.3f} ± {r['after_se']:.3f}"


def _gain(r: dict) -> str:
    return f"{r['gain']:+.3f} ± {r['gain_se']:.3f} ({_f(r['z'], '.1f')})"


def _load(r: dict) -> str:
    ld = r["load"]
    return f"{ld['mean']:.1f} (max {ld['max']:.1f}, {ld['nproc']} cores)"


def async_vs_sync(results: dict[str, dict], seeds=SEEDS) -> dict:
    """Per seed with both A cells: ``diff`` = gain_async - gain_sync = after_async - after_sync (the
    greedy before is the same) with its se over prompts, and ``wall_ratio`` = loop wall async / sync;
    pooled over those seeds: mean diff ± std/sqrt(n) (None below 2 seeds) and mean wall ratio."""
    per = []
    for s in seeds:
        a, y = results.get(f"A_async_s{s}"), results.get(f"A_sync_s{s}")
        if a and y:
            per.append({"seed": s, "diff": a["gain"] - y["gain"], "diff_se": math.hypot(a["after_se"], y["after_se"]),
                        "wall_ratio": a["loop_wall_s"] / y["loop_wall_s"],
                        "load_mean": (a["load"]["mean"], y["load"]["mean"])})
    out = {"per_seed": per, "n": len(per)}
    if len(per) >= 2:
        d = [p["diff"] for p in per]
        out.update(diff_mean=statistics.mean(d), diff_se=statistics.stdev(d) / math.sqrt(len(d)),
                   wall_ratio_mean=statistics.mean(p["wall_ratio"] for p in per))
    elif per:
        out.update(diff_mean=per[0]["diff"], diff_se=per[0]["diff_se"], wall_ratio_mean=per[0]["wall_ratio"])
    return out


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
             f"{pilot_steps} per pilot. Held-out: greedy pass@1 on the demo's 128 eval rows (32 products "
             "training never sees), before step 1 and after the last; ± = standard error over prompts; "
             "(z) = gain / sqrt(se_before² + se_after²). KL = mean `kl/ref_k1` over the last 4 steps "
             "(nats per completion token, the batch's own samples). Load = 1-minute load average during the "
             "run: **wall times and their ratios measured under load are not the paper's comparison** "
             "(quality numbers are: the handshake bounds staleness at any speed).", ""]
    a_cells = [c for c in cells if c.group == "A"]
    lines += ["## A. Sync vs one-step async Online DPO (Noukhovitch et al. 2024, Tables 1-2)", "",
              "| cell | seed | mode | pass@1 before -> after | gain ± se (z) | mean@2 before -> after | KL k1 | "
              "staleness mean | loop wall (min) | load avg |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in a_cells:
        r = res(c)
        if r:
            mk = r.get("mean@k") or {}
            lines.append(f"| {c.name} | {c.seed} | {'sync' if c.sync else 'async N=1'} | {_ba(r)} | {_gain(r)} | "
                         f"{_f(mk.get('before'))} -> {_f(mk.get('after'))} | {_f(r['kl_k1'], '.4f')} | "
                         f"{_f(r['staleness_mean'], '.2f')} | {r['loop_wall_s'] / 60:.1f} | {_load(r)} |")
    avs = async_vs_sync(results)
    lines.append("")
    for p in avs["per_seed"]:
        lines.append(f"- seed {p['seed']}: gain async - sync = {p['diff']:+.3f} ± {p['diff_se']:.3f}; loop wall "
                     f"async / sync = {p['wall_ratio']:.2f} (load {p['load_mean'][0]:.1f} / {p['load_mean'][1]:.1f})")
    if avs["n"]:
        how = "std/sqrt(n) over seeds" if avs["n"] >= 2 else "se over prompts, one seed"
        lines.append(f"- **{avs['n']} seed(s): gain async - sync = {avs['diff_mean']:+.3f} ± {avs['diff_se']:.3f} "
                     f"({how}); wall async / sync = {avs['wall_ratio_mean']:.2f}** (under the load shown)")
    lines.append("")
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
              "token_mult_prob_error | TIS weight mean | TIS capped frac | loop wall (min) | load avg |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        r = res(c) if c.name.startswith("B_") else None
        if r:
            lines.append(f"| {c.loss} | {c.n} | {r['lr']:g} | {_ba(r)} | {_gain(r)} | {_f(r['kl_k1'], '.4f')} | "
                         f"{_f(r['staleness_mean'], '.2f')} | {_f(r['token_mult_prob_error_mean'], '.4f')} | "
                         f"{_f(r['tis_weight_mean'], '.4f')} | {_f(r['tis_capped_frac'], '.4f')} | "
                         f"{r['loop_wall_s'] / 60:.1f} | {_load(r)} |")
    missing = [c.name for c in cells if res(c) is None and c.group != "ppo"]
    optional = [c.name for c in cells if res(c) is None and c.group == "ppo"]
    lines += ["", "## Not run yet", ""]
    if missing:
        lines += [f"{len(missing)} cell(s): {' '.join(missing)}", "",
                  "    nice -n 15 python bench/seeds_repro.py --only " + " ".join(missing), ""]
    else:
        lines += ["none of grids A, P, B: every cell is finished", ""]
    if optional:
        lines += [f"PPO (if the time allows): {' '.join(optional)} (`--only ppo`)"]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    _plot(out, results, cells)
    return text


def _save(fig, ax, title: str, path: Path) -> None:
    """Title, legend (when anything is labelled), tight layout; write ``path`` (PNG) and close."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(out: Path, results: dict[str, dict], cells: list[Cell]) -> None:
    """``gain_vs_N.png`` (per loss, error bars = se) and ``gain_vs_wall.png`` (grid A)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, loss in enumerate(dict.fromkeys(c.loss for c in cells if c.name.startswith("B_"))):
        pts = []
        for c in cells:
            if c.name.startswith("B_") and c.loss == loss:
                r = results.get(c.alias or c.name)
                if r:
                    pts.append((c.n * (1 + 0.04 * (i - 1)), r["gain"], r["gain_se"]))
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=loss)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(N_VALUES), [str(n) for n in N_VALUES])
    ax.set_xlabel("N = async.sync_interval = max_staleness (16 = never synced)")
    ax.set_ylabel("held-out gain (after - before), ± se")
    _save(fig, ax, "Held-out gain vs off-policyness N (seed 0)", out / "gain_vs_N.png")

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for mode, marker in (("sync", "s"), ("async", "o")):
        pts = [(r["loop_wall_s"] / 60, r["gain"], r["gain_se"], c.seed) for c in cells
               if c.group == "A" and (c.sync == (mode == "sync")) and (r := results.get(c.name))]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker=marker,
                        ls="none", capsize=3, label=f"{mode} Online DPO")
            for p in pts:
                ax.annotate(f"s{p[3]}", (p[0], p[1]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("loop wall time (min; under the load average recorded in results.md)")
    ax.set_ylabel("held-out gain, ± se")
    _save(fig, ax, "Gain vs wall time: sync vs one-step async", out / "gain_vs_wall.png")


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
    res = cell_result(cell, lr, ov, summary, rows, load_avg, call_wall)
    path = args.out / f"{cell.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(path)     # a half-written JSON never counts as finished
    print(f"[seeds_repro] {cell.name}: {res['metric']} {res['before']:.3f} -> {res['after']:.3f} "
          f"(gain {res['gain']:+.3f} ± {res['gain_se']:.3f}), KL {res['kl_k1']}, staleness "
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
                    help="groups (A, B, P, ppo) or cell names, space- or comma-separated (default: all but ppo)")
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
    ap.add_argument("--table", action="store_true", help="only rewrite results.md and the plots")
    ap.add_argument("--list", action="store_true", help="print the cells and whether each is finished")
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
        for c in todo:
            print(f"{c.name:24} {'done' if c.name in results or c.alias in results else '-'}")
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
