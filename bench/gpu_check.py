"""One-GPU check of the learner, sized for one H200 machine: at most ``--budget-min`` minutes
(default 8), under ``--disk-gb`` of disk (default 10), each result printed and appended to
``--out`` (JSON lines) as soon as it is measured, so a crash or a time-out keeps what ran.

    python bench/gpu_check.py                   # one GPU, rows -> runs/gpu_check.jsonl (H200: bench/README.md)
    python bench/gpu_check.py --dry-run         # CPU, tiny shapes, the same code (CI runs it); rows -> $TMPDIR

Sections, in order (each in its own try/except: a failure is recorded in its row and the next
section runs; a section whose time estimate no longer fits the budget is skipped and says so):

* ``env``: device, torch / megatron-core / transformers versions, Transformer Engine (megatron's
  ``HAVE_TE``; installed TE is reported, not a failure), free disk.
* per preset (``--presets``, default ``llama-1b,llama-3b``: Llama-3.2-1B / -3B shapes, random
  N(0, 0.02) weights written in bf16 and deleted after the preset):
  ``prepare-P`` (weights + learner build: policy + frozen reference in bf16 with fp32 master
  weights, distributed optimizer, one rank), ``logprobs-P`` (megatron's token logprobs on CUDA in
  bf16 against transformers' ``LlamaForCausalLM`` in bf16 on the same weights: mean and max
  |diff| over completion tokens, nats; the number the weight-sync probe check sees between two
  bf16 stacks; and megatron's RoPE inverse frequencies against transformers' for the preset's
  config, relative 1e-5: ``llama-3b`` and the dry run's ``tiny`` carry Llama-3.1 ``rope_scaling``,
  the scaling the 8B/70B recipes' models use), ``train-P`` (``--warmup`` + ``--steps`` Online DPO train steps: step time, real
  tokens/s, MFU against the GPU's dense bf16 peak from ``megatron_rlhf.platform.peaks``,
  peak memory against ``tools/plan_memory.py`` with the attention term of the spec actually built:
  fused for TE or SDPA's flash kernel on CUDA), ``pack-P`` (the on-device weight pack against a
  same-device memcpy: ``megatron_rlhf.learner.weights.measure_pack``; skipped with the
  ImportError where that function does not exist yet), ``pack-host-P`` (review 2, N14: the
  host-staged publish, ``measure_pack(..., staging="host")``: the pack into pinned host memory and
  each chunk copied back into one of two device wire buffers, the path an exporter takes when its
  stage copy does not fit next to the learner, which is what the 8B and 70B recipes' headers
  say their plan decides; at the recipes' 256 MiB chunk; the broadcast itself is not timed).
* ``checkpoint`` (after the first preset): a distributed-optimizer checkpoint round trip of a
  4-layer model of Llama-3.2-1B's layer shape (``llama-1b-4l``; policy + optimizer + the run's one
  shared reference, ~5 GB, deleted afterwards): save, one more step, load, the same step again;
  restored master weights and Adam moments must equal the saved ones exactly, and the repeated
  step must give the same master weights (within 1e-2 of the update on GPU, 1e-6 on CPU).

Exit code: 0 when every section that ran passed (skipped sections are not failures), 1 otherwise,
2 on bad arguments or no GPU without ``--dry-run``. ``--dry-run`` re-runs this script on CPU in a
subprocess where importing ray, vllm or transformer_engine fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "vllm", "transformer_engine")
CHECKPOINT_PRESET = "llama-1b-4l"
#: rough seconds per billion parameters (GPU) of each section, plus a fixed part: the budget rule
#: (calibrate from the ``seconds`` of a recorded run)
ESTIMATE_S = {"prepare": (15, 25), "logprobs": (5, 5), "train": (30, 15), "pack": (5, 5), "pack-host": (5, 5),
              "checkpoint": (20, 120)}


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class Report:
    """Prints each row and appends it to ``out`` (JSON lines) at once; tracks time and disk."""

    def __init__(self, out: Path, workdir: Path, budget_s: float, disk_limit_gb: float):
        self.out, self.workdir, self.budget_s, self.disk_limit_gb = out, workdir, budget_s, disk_limit_gb
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        out.parent.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def emit(self, row: dict) -> dict:
        row["elapsed_s"] = round(self.elapsed(), 1)
        row["disk_GB"] = round(_dir_bytes(self.workdir) / 1e9, 3)
        row["max_disk_GB"] = max([row["disk_GB"], row.get("peak_disk_GB", 0)]
                                 + [r.get("max_disk_GB", 0) for r in self.rows])
        if row["max_disk_GB"] > self.disk_limit_gb and row["status"] == "ok":
            row.update(status="failed", error=f"disk {row['max_disk_GB']} GB > --disk-gb {self.disk_limit_gb}")
        self.rows.append(row)
        with open(self.out, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        keys = [k for k in row if k not in ("section", "status", "elapsed_s", "traceback")]
        print(f"[{row['elapsed_s']:6.1f} s] {row['section']:<22} {row['status']:<8} "
              + " ".join(f"{k}={row[k]}" for k in keys), flush=True)
        return row

    def run(self, section: str, estimate_s: float, fn) -> dict:
        """Run ``fn() -> dict`` as ``section`` unless ``estimate_s`` no longer fits the budget."""
        left = self.budget_s - self.elapsed()
        if estimate_s > left:
            return self.emit({"section": section, "status": "skipped",
                              "reason": f"budget: needs ~{estimate_s:.0f} s, {max(left, 0):.0f} s of "
                                        f"{self.budget_s:.0f} s left (--budget-min)"})
        t = time.perf_counter()
        try:
            row = {"status": "ok", **(fn() or {})}
        except Exception as e:   # recorded in the row; the next section runs
            row = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
        return self.emit({"section": section, **row, "seconds": round(time.perf_counter() - t, 2)})


def _estimate(kind: str, params_b: float, dry: bool) -> float:
    fixed, per_b = ESTIMATE_S[kind]
    return 0.5 if dry else fixed + per_b * params_b


def _plan_gib(hf, micro_batch: int, seq: int, attention: str) -> float:
    """plan_memory's learner estimate (GiB, overhead excluded) for TP=PP=DP=1, distributed optimizer."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mrlhf_plan_memory", REPO / "tools" / "plan_memory.py")
    pm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pm
    spec.loader.exec_module(pm)
    shape = pm.shape_from_hf_config(hf.to_dict())
    lay = pm.LearnerLayout(tp=1, pp=1, dp=1, micro_batch=micro_batch, seq_len=seq,
                           distributed_optimizer=True, attention=attention)
    return pm.learner_memory(shape, lay)["total"] / 2**30


def _learner(model_dir: Path, a, total_steps: int):
    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner

    cfg = LearnerConfig(micro_batch_size=a.mbs, distributed_optimizer=True,
                        optimizer=OptimizerConfig(lr=a.lr, adam_eps=1e-3, clip_grad=1.0))
    return MegatronLearner(model_dir=str(model_dir), learner_cfg=cfg, algorithm_cfg=AlgorithmConfig(),
                           dtype=a.dtype, total_steps=total_steps)


def _params_b(preset: str) -> float:
    from bench.learner import PRESETS

    p = PRESETS[preset]
    h, f, L, V = p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"], p["vocab_size"]
    d = h // p["num_attention_heads"]
    layer = h * d * (p["num_attention_heads"] * 2 + 2 * p["num_key_value_heads"]) + 3 * h * f
    return (L * layer + V * h * (1 if p.get("tie_word_embeddings") else 2)) / 1e9


# ----------------------------------------------------------------------------------- sections
def env_row(workdir: Path) -> dict:
    """Versions, device, Transformer Engine as megatron sees it, free disk."""
    from importlib import metadata

    import torch

    def ver(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    row = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)",
           "torch": torch.__version__, "megatron_core": ver("megatron-core"),
           "transformers": ver("transformers"), "python": sys.version.split()[0],
           "free_disk_GB": round(shutil.disk_usage(workdir).free / 1e9, 1)}
    if torch.cuda.is_available():
        from megatron_rlhf.platform import bf16_peak_flops
        from megatron_rlhf.platform.gpu import TransformerEngineMismatch, have_transformer_engine

        peak = bf16_peak_flops(row["device"])
        row["bf16_peak_TFLOPs"] = None if peak is None else peak / 1e12
        try:
            row["transformer_engine"] = have_transformer_engine()
        except TransformerEngineMismatch as e:
            row.update(status="failed", transformer_engine="mismatch", error=str(e))
    else:
        row["transformer_engine"] = False
    return row


def layer_submodules(layer_spec):
    """The submodules of one transformer layer of a GPT ``layer_spec``, for both shapes megatron
    takes: the local spec's ``ModuleSpec(TransformerBlock)`` (``submodules.layer_specs[0]``,
    :func:`megatron_rlhf.platform.local_spec.local_layer_spec`) and Transformer Engine's
    ``ModuleSpec(TransformerLayer)`` (its ``submodules`` are the layer's;
    ``get_gpt_layer_with_transformer_engine_spec``). Review 2, N3: reading ``layer_specs`` of the
    TE spec raised AttributeError on every TE node."""
    sm = layer_spec.submodules
    return sm.layer_specs[0].submodules if hasattr(sm, "layer_specs") else sm


def prepare(preset: str, a, workdir: Path, state: dict) -> dict:
    from bench.learner import write_random_llama

    t = time.perf_counter()
    model_dir = write_random_llama(workdir / f"weights_{preset}", preset, "bfloat16")
    write_s = time.perf_counter() - t
    state["model_dir"] = model_dir
    t = time.perf_counter()
    learner = _learner(model_dir, a, total_steps=a.warmup + a.steps + 2)
    state["learner"] = learner
    spec = learner.model_spec
    layer = layer_submodules(spec.layer_spec)
    return {"weights_write_s": round(write_s, 1), "build_s": round(time.perf_counter() - t, 1),
            "params_M": round(sum(p.numel() for p in learner.policy.parameters()) / 1e6, 1),
            "core_attention": getattr(layer.self_attention.submodules.core_attention, "__name__", "?"),
            "bias_activation_fusion": spec.config.bias_activation_fusion,
            "apply_rope_fusion": spec.config.apply_rope_fusion}


def logprobs_vs_transformers(a, state: dict) -> dict:
    """Megatron bf16 token logprobs against transformers bf16 on the same weights and device."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.learner import make_batch

    learner = state["learner"]
    batch = make_batch(max(1, a.pairs // 4), a.seq, learner.vocab_size, True, seed=0)
    mine = learner.token_logprobs(batch.input_ids)[:, 1:].float()        # [B, S-1]
    device = learner.platform.device
    hf = AutoModelForCausalLM.from_pretrained(str(state["model_dir"]), dtype=torch.bfloat16).to(device).eval()
    ids = batch.input_ids.to(device)
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
    del hf, logits
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    mask = batch.loss_mask[:, 1:].bool()
    d = (mine - ref).abs()[mask]
    row = {"tokens": int(mask.sum()), "mean_abs_diff": round(float(d.mean()), 5),
           "max_abs_diff": round(float(d.max()), 4), "hf_logprob_std": round(float(ref[mask].std()), 3),
           "mean_tol": a.logprob_tol, **rope_vs_transformers(learner, state["model_dir"])}
    if not row["mean_abs_diff"] <= a.logprob_tol:
        row.update(status="failed", error=f"mean |diff| {row['mean_abs_diff']} > --logprob-tol {a.logprob_tol}")
    elif not row["rope_inv_freq_max_rel_diff"] <= ROPE_TOL:
        row.update(status="failed", error=f"RoPE inverse frequencies ({row['rope_type']}) differ from transformers' "
                                          f"by {row['rope_inv_freq_max_rel_diff']} (relative) > {ROPE_TOL}")
    return row


#: relative tolerance of megatron's RoPE inverse frequencies against transformers' (both fp32)
ROPE_TOL = 1e-5


def rope_vs_transformers(learner, model_dir) -> dict:
    """Megatron's RoPE inverse frequencies (the policy's ``RotaryEmbedding.inv_freq``) against
    transformers' for the same HF config (``ROPE_INIT_FUNCTIONS[rope_type]``), with the rope type.
    A short sequence hardly exercises the low frequencies that Llama-3.1 scaling changes (their
    angles stay small), so the logprob gate alone would pass a dropped ``rope_scaling``; the
    frequencies are compared directly. Returns ``rope_type`` and ``rope_inv_freq_max_rel_diff``."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(str(model_dir))
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", "default") or "default"
    if kind == "default":
        base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        dim = cfg.hidden_size // cfg.num_attention_heads
        ref = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    else:
        ref = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")[0].float()
    rope = [m for m in learner.policy.modules() if type(m).__name__ == "RotaryEmbedding"]
    if not rope:
        raise RuntimeError("the policy has no RotaryEmbedding module (megatron GPTModel.rotary_pos_emb)")
    mine = rope[0].inv_freq.detach().float().cpu()
    rel = float(((mine - ref).abs() / ref.abs()).max()) if mine.shape == ref.shape else float("inf")
    return {"rope_type": kind, "rope_inv_freq_max_rel_diff": rel}


def train_steps(a, state: dict) -> dict:
    import torch

    from bench.learner import make_batch, model_flops_per_token
    from megatron_rlhf.platform import bf16_peak_flops

    learner = state["learner"]
    hf = learner.hf_config
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
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
            flops += sum(n * 4 * model_flops_per_token(hf, n) for n in lengths)   # 3x policy + 1x reference
    secs = sum(times)
    peak = bf16_peak_flops(torch.cuda.get_device_name()) if cuda else None
    attention = "fused" if cuda else "unfused"   # TE or SDPA flash on CUDA; SDPA math on CPU
    row = {"step_s": round(secs / len(times), 4), "tokens_per_s": round(tokens / secs, 1),
           "mfu": None if peak is None else round(flops / secs / peak, 4),
           "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           "plan_GiB": round(_plan_gib(hf, a.mbs, a.seq, attention), 2), "plan_attention": attention,
           "pairs": a.pairs, "seq": a.seq, "micro_batch": a.mbs}
    if row["peak_GiB"] is not None and row["peak_GiB"] > row["plan_GiB"] * (1 + a.mem_slack):
        row.update(status="failed", error=f"peak {row['peak_GiB']} GiB > plan {row['plan_GiB']} GiB "
                                          f"x (1 + --mem-slack {a.mem_slack})")
    return row


def pack(a, state: dict) -> dict:
    try:
        from megatron_rlhf.learner.weights import measure_pack
    except ImportError as e:
        return {"status": "skipped", "reason": f"skipped: measure_pack not available ({e})"}
    buckets = (1, 4) if a.dry_run else (64, 256, 1024)
    rows = measure_pack(state["learner"].policy, state["learner"].hf_config, bucket_mb=buckets, repeats=3)
    ok = bool(rows) and all(r["pack_GBps"] > 0 and r["memcpy_GBps"] > 0 for r in rows)
    return {"status": "ok" if ok else "failed", "buckets": rows}


def pack_host(a, state: dict) -> dict:
    """The host-staged publish (``measure_pack(..., staging="host")``): pinned device -> host pack,
    then host -> device into the wire buffers, at the recipes' 256 MiB chunk (1 MiB in the dry run)."""
    from megatron_rlhf.learner.weights import measure_pack

    rows = measure_pack(state["learner"].policy, state["learner"].hf_config,
                        bucket_mb=(1,) if a.dry_run else (256,), repeats=3, staging="host")
    ok = bool(rows) and all(r["staging"] == "host" and r["pack_GBps"] > 0 and r["memcpy_GBps"] > 0 for r in rows)
    return {"status": "ok" if ok else "failed", "buckets": rows}


def release(state: dict) -> None:
    """Close the preset's learner and delete its weights (disk bound)."""
    learner = state.pop("learner", None)
    if learner is not None:
        learner.close()
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    model_dir = state.pop("model_dir", None)
    if model_dir is not None:
        shutil.rmtree(model_dir, ignore_errors=True)


def checkpoint_round_trip(a, workdir: Path) -> dict:
    import torch

    from bench.learner import make_batch, write_random_llama
    from megatron_rlhf.learner.checkpoint import distributed_optimizer_state

    preset = "tiny" if a.dry_run else CHECKPOINT_PRESET
    model_dir = write_random_llama(workdir / f"weights_{preset}", preset, "bfloat16")
    root = workdir / "checkpoints"
    learner = _learner(model_dir, a, total_steps=4)
    try:
        vocab = learner.vocab_size
        learner.train_step(make_batch(a.pairs, a.seq, vocab, True, seed=1))
        saved = distributed_optimizer_state(learner.optimizer, learner.policy)
        before = {n: s["param"] for n, s in saved.items()}
        t = time.perf_counter()
        learner.save_checkpoint(str(root / "step_1" / "learner"), str(root))
        save_s, size = time.perf_counter() - t, _dir_bytes(root)
        nxt = make_batch(a.pairs, a.seq, vocab, True, seed=999)
        learner.train_step(nxt)
        stepped = distributed_optimizer_state(learner.optimizer, learner.policy)
        t = time.perf_counter()
        learner.load_checkpoint(str(root / "step_1" / "learner"))
        load_s = time.perf_counter() - t
        restored = distributed_optimizer_state(learner.optimizer, learner.policy)
        learner.train_step(nxt)
        again = distributed_optimizer_state(learner.optimizer, learner.policy)
    finally:
        learner.close()
        peak_disk = _dir_bytes(workdir)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)

    def max_diff(x, y):
        return max(((x[n][k] - y[n][k]).abs().max().item() for n in x for k in ("param", "exp_avg", "exp_avg_sq")),
                   default=float("inf"))

    update = max((stepped[n]["param"] - before[n]).abs().max().item() for n in before)
    restore, next_step = max_diff(saved, restored), max_diff(stepped, again)
    tol = 1e-2 * update if torch.cuda.is_available() else 1e-6
    row = {"preset": preset, "ckpt_GB": round(size / 1e9, 3), "peak_disk_GB": round(peak_disk / 1e9, 3),
           "save_s": round(save_s, 1), "load_s": round(load_s, 1), "restore_max_abs": restore,
           "next_step_max_abs": next_step, "update_max_abs": update, "next_step_tol": tol}
    if not (restore == 0.0 and next_step <= tol and update > 0):
        row.update(status="failed", error="restored optimizer state or the repeated step differs")
    return row


# ----------------------------------------------------------------------------------- main
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


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes, in a subprocess where ray/vllm/transformer_engine cannot be imported")
    ap.add_argument("--out", default=None, help="JSON lines file the rows are appended to (default: "
                    "runs/gpu_check.jsonl; --dry-run: gpu_check_dry_run.jsonl in the system temp dir)")
    ap.add_argument("--budget-min", type=float, default=8.0, help="total time budget; later sections that no "
                    "longer fit are skipped")
    ap.add_argument("--disk-gb", type=float, default=10.0, help="most disk the check may use under --workdir")
    ap.add_argument("--presets", default=None, help="comma-separated bench/learner.py presets "
                    "(default llama-1b,llama-3b; --dry-run: tiny)")
    ap.add_argument("--pairs", type=int, default=None, help="preference pairs per step (default 8; dry run 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; dry run 64)")
    ap.add_argument("--mbs", type=int, default=4, help="learner.micro_batch_size (sequences)")
    ap.add_argument("--steps", type=int, default=3, help="timed Online DPO steps per learner preset")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them (compilation, allocator)")
    ap.add_argument("--dtype", default="bfloat16", help="the trained dtype (fp32 master weights)")
    ap.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate of those steps")
    ap.add_argument("--logprob-tol", type=float, default=0.05,
                    help="mean |megatron - transformers| bf16 token logprob allowed (nats)")
    ap.add_argument("--mem-slack", type=float, default=0.25, help="allowed excess of peak memory over the plan")
    ap.add_argument("--workdir", default=None, help="weights and checkpoints (default: a temp dir; emptied at the end)")
    ap.add_argument("--_inner", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dry_run and not a._inner:   # re-run this script with the blocked imports, on CPU
        args = list(argv if argv is not None else sys.argv[1:]) + ["--_inner"]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        return subprocess.run([sys.executable, "-c", _BLOCKER, *args], env=env).returncode
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible; run with --dry-run on CPU", file=sys.stderr)
        return 2
    if a.out is None:   # never the working directory (a repo checkout): runs/ is git-ignored
        a.out = (str(Path(tempfile.gettempdir()) / "gpu_check_dry_run.jsonl") if a.dry_run
                 else str(REPO / "runs" / "gpu_check.jsonl"))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    presets = (a.presets or ("tiny" if a.dry_run else "llama-1b,llama-3b")).split(",")
    a.pairs = a.pairs or (4 if a.dry_run else 8)
    a.seq = a.seq or (64 if a.dry_run else 1024)
    own_workdir = a.workdir is None
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rep = Report(Path(a.out), workdir, a.budget_min * 60, a.disk_gb)
    rep.run("env", 0, lambda: env_row(workdir))
    try:
        for i, preset in enumerate(presets):
            state: dict = {}
            pb = _params_b(preset)
            prep = rep.run(f"prepare-{preset}", _estimate("prepare", pb, a.dry_run), lambda: prepare(preset, a, workdir, state))
            for kind, fn in (("logprobs", logprobs_vs_transformers), ("train", train_steps), ("pack", pack),
                             ("pack-host", pack_host)):
                if "learner" not in state:
                    rep.emit({"section": f"{kind}-{preset}", "status": "skipped",
                              "reason": f"prepare-{preset} {prep['status']}"})
                    continue
                rep.run(f"{kind}-{preset}", _estimate(kind, pb, a.dry_run), lambda fn=fn: fn(a, state))
            release(state)
            if i == 0:
                cpb = _params_b("tiny" if a.dry_run else CHECKPOINT_PRESET)
                rep.run("checkpoint", _estimate("checkpoint", cpb, a.dry_run), lambda: checkpoint_round_trip(a, workdir))
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        else:   # leave the folder, not what this run wrote into it
            for p in workdir.glob("weights_*"):
                shutil.rmtree(p, ignore_errors=True)
    failed = [r["section"] for r in rep.rows if r["status"] == "failed"]
    if a.dry_run:
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        if leaked:
            print(f"gpu_check: imported {leaked}", file=sys.stderr)
            return 1
    print(f"gpu_check: {len(rep.rows)} rows in {rep.elapsed():.0f} s -> {a.out}; "
          + (f"FAILED: {', '.join(failed)}" if failed else "every section that ran passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
