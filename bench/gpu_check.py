"""One-GPU check of the learner: bf16 train steps with fp32 master weights, MFU, memory against
``tools/plan_memory.py``, bf16-vs-fp32 logprobs and a distributed-optimizer checkpoint round trip.

    python bench/gpu_check.py                 # one GPU: Llama-3.2-1B and -3B shapes, random weights
    python bench/gpu_check.py --dry-run       # CPU, tiny shapes, the same code and table (CI runs it)

Needs PyTorch, megatron-core, transformers and safetensors only: nothing here imports ray, vllm or
transformer_engine (``--dry-run`` runs the check in a subprocess where importing them fails; on a
GPU with Transformer Engine installed the learner's platform picks TE's layer spec by itself).
Per model (``bench/learner.py``'s presets, N(0, 0.02) weights written once to ``--workdir``):

1. an fp32 learner's per-token logprobs of a synthetic Online DPO batch (then freed);
2. a bf16 learner (fp32 master weights, ``learner.distributed_optimizer``, one rank): its logprobs
   of the same batch against the fp32 ones (mean and max |difference| per real token, nats;
   mismatch above ``--logprob-tol`` / 10 x that), then ``--warmup`` + ``--steps`` timed train
   steps: step time, real tokens/s, MFU (model FLOPs as ``bench/learner.py`` counts them, against
   the GPU's bf16 dense peak), peak memory (``torch.cuda.max_memory_allocated``) against
   plan_memory's estimate for the same layout (mismatch when the measurement exceeds it by more
   than ``--mem-slack``);
3. checkpoint: save (megatron dist_checkpointing, sharded optimizer state), one more step, load
   the checkpoint back: the restored fp32 master weights and Adam moments must equal the saved ones
   exactly, and the step repeated after the load must give the same master weights (within
   1e-2 of that step's update on GPU, where kernels need not be bitwise deterministic; 1e-6 on
   CPU).

Prints one table (and ``--json`` rows) and exits 1 on any mismatch, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "vllm", "transformer_engine")
COLUMNS = ("model", "dtype", "params_M", "step_s", "tokens_per_s", "mfu", "peak_GiB", "plan_GiB",
           "logprob_mean_abs", "logprob_max_abs", "ckpt_restore_max_abs", "ckpt_next_step_max_abs", "ok")


def _plan_gib(hf, micro_batch: int, seq: int) -> float:
    """plan_memory's learner estimate (GiB, no overhead) for TP=PP=DP=1 with the distributed optimizer."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mrlhf_plan_memory", REPO / "tools" / "plan_memory.py")
    pm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pm
    spec.loader.exec_module(pm)
    shape = pm.shape_from_hf_config(hf.to_dict())
    lay = pm.LearnerLayout(tp=1, pp=1, dp=1, micro_batch=micro_batch, seq_len=seq, distributed_optimizer=True)
    return pm.learner_memory(shape, lay)["total"] / 2**30


def _learner(model_dir: Path, dtype: str, a):
    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner

    cfg = LearnerConfig(micro_batch_size=a.mbs, distributed_optimizer=True,
                        optimizer=OptimizerConfig(lr=a.lr, adam_eps=1e-3, clip_grad=1.0))
    return MegatronLearner(model_dir=str(model_dir), learner_cfg=cfg, algorithm_cfg=AlgorithmConfig(),
                           dtype=dtype, total_steps=a.warmup + a.steps + 2)


def _token_logprobs(learner, batch):
    """``[B, S]`` policy token logprobs on the completion tokens (0 elsewhere) and their count."""
    tok = learner.token_logprobs(batch.input_ids).float()      # [B, S], column t = log p(x_t | x_<t)
    return tok * batch.loss_mask, batch.loss_mask.sum()


def _max_diff(a: dict, b: dict) -> float:
    return max(((a[n][k] - b[n][k]).abs().max().item() for n in a for k in ("param", "exp_avg", "exp_avg_sq")),
               default=float("inf"))


def check_model(preset: str, a, workdir: Path) -> dict:
    """Steps 1-3 of the module doc for one preset; returns a table row (``ok`` False on mismatch)."""
    import torch

    from bench.learner import make_batch, model_flops_per_token, peak_flops, write_random_llama
    from megatron_rlhf.learner.checkpoint import distributed_optimizer_state

    model_dir = workdir / f"gpu_check_{preset}"
    if not (model_dir / "config.json").is_file():
        write_random_llama(model_dir, preset, "float32")
    cuda = torch.cuda.is_available()
    fp32 = _learner(model_dir, "float32", a)
    hf = fp32.hf_config
    batch = make_batch(a.pairs, a.seq, hf.vocab_size, True, seed=0)
    ref, n_tok = _token_logprobs(fp32, batch)
    params = sum(p.numel() for p in fp32.policy.parameters())
    fp32.close()
    del fp32
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    learner = _learner(model_dir, a.dtype, a)
    got, _ = _token_logprobs(learner, batch)
    diff = (got.cpu() - ref.cpu()).abs()
    row = {"model": preset, "dtype": a.dtype, "params_M": round(params / 1e6, 2),
           "logprob_mean_abs": round(float(diff.sum() / n_tok), 5), "logprob_max_abs": round(float(diff.max()), 4)}
    times, flops, tokens = [], 0.0, 0
    for step in range(a.warmup + a.steps):
        b = make_batch(a.pairs, a.seq, hf.vocab_size, True, seed=step + 1)
        learner.platform.synchronize()
        t = time.perf_counter()
        learner.train_step(b)
        learner.platform.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t)
            lengths = [int(x) for x in (b.loss_mask.cumsum(1).argmax(1) + 1).tolist()]
            tokens += sum(lengths)
            flops += sum(n * 4 * model_flops_per_token(hf, n) for n in lengths)
    secs = sum(times)
    peak, _ = peak_flops("cuda" if cuda else "cpu", a.peak_tflops)
    row.update(step_s=round(secs / len(times), 4), tokens_per_s=round(tokens / secs, 1),
               mfu=None if peak is None else round(flops / secs / peak, 4),
               peak_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               plan_GiB=round(_plan_gib(hf, a.mbs, a.seq), 2))
    # 3. checkpoint round trip through the sharded optimizer state
    ckpt = Path(tempfile.mkdtemp(prefix="ckpt_", dir=workdir))
    saved = distributed_optimizer_state(learner.optimizer, learner.policy)
    before = {n: s["param"] for n, s in saved.items()}
    learner.save_checkpoint(str(ckpt))
    nxt = make_batch(a.pairs, a.seq, hf.vocab_size, True, seed=999)
    learner.train_step(nxt)
    stepped = distributed_optimizer_state(learner.optimizer, learner.policy)
    learner.load_checkpoint(str(ckpt))
    restored = distributed_optimizer_state(learner.optimizer, learner.policy)
    learner.train_step(nxt)
    again = distributed_optimizer_state(learner.optimizer, learner.policy)
    learner.close()
    update = max((stepped[n]["param"] - before[n]).abs().max().item() for n in before)
    row.update(ckpt_restore_max_abs=_max_diff(saved, restored), ckpt_next_step_max_abs=_max_diff(stepped, again))
    next_tol = 1e-2 * update if cuda else 1e-6
    row["ok"] = bool(row["logprob_mean_abs"] <= a.logprob_tol and row["logprob_max_abs"] <= 10 * a.logprob_tol
                     and row["ckpt_restore_max_abs"] == 0.0 and row["ckpt_next_step_max_abs"] <= next_tol
                     and update > 0
                     and (row["peak_GiB"] is None or row["peak_GiB"] <= row["plan_GiB"] * (1 + a.mem_slack)))
    return row


def format_table(rows: list[dict], header: str) -> str:
    """The check's table: one line per model, the columns of ``COLUMNS``."""
    def cell(v):
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[c for c in COLUMNS]] + [[cell(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = [header] + ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


_BLOCKER = f"""
import importlib.abc, runpy, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"gpu_check: {{name}} is blocked (as on a bare GPU machine)", name=name)
        return None
sys.meta_path.insert(0, _Block())
sys.argv = [{str(Path(__file__).resolve())!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes, in a subprocess where ray/vllm/transformer_engine cannot be imported")
    ap.add_argument("--presets", default=None, help="comma-separated bench/learner.py presets "
                    "(default llama-1b,llama-3b; --dry-run: tiny)")
    ap.add_argument("--pairs", type=int, default=None, help="preference pairs per step (default 8; dry run 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; dry run 64)")
    ap.add_argument("--mbs", type=int, default=4, help="learner.micro_batch_size (sequences)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="the trained dtype (fp32 master weights)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--logprob-tol", type=float, default=0.02,
                    help="mean |bf16 - fp32| token logprob allowed (nats); max allowed is 10x")
    ap.add_argument("--mem-slack", type=float, default=0.15, help="allowed excess of peak memory over the plan")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--workdir", default=None, help="random weights and checkpoints (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    ap.add_argument("--_inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.dry_run and not a._inner:   # re-run this script with the blocked imports, on CPU
        args = [x for x in (argv if argv is not None else sys.argv[1:])] + ["--_inner"]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        return subprocess.run([sys.executable, "-c", _BLOCKER, *args], env=env).returncode
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible; run with --dry-run on CPU", file=sys.stderr)
        return 2
    presets = (a.presets or ("tiny" if a.dry_run else "llama-1b,llama-3b")).split(",")
    a.pairs = a.pairs or (4 if a.dry_run else 8)
    a.seq = a.seq or (64 if a.dry_run else 1024)
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)"
    rows = [check_model(p, a, workdir) for p in presets]
    header = (f"gpu_check {time.strftime('%Y-%m-%d')} on {device}: {a.dtype} + fp32 master weights, "
              f"distributed optimizer, {a.pairs} pairs x {a.seq} tokens, micro-batch {a.mbs}, "
              f"torch {torch.__version__}")
    print(format_table(rows, header))
    if a.json:
        print(json.dumps(rows))
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    if leaked:
        print(f"gpu_check: imported {leaked}", file=sys.stderr)
        return 1
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
