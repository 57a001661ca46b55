"""Score any HF model folder on a recipe's held-out prompts, exactly as the trainer's eval does.

    .venv/bin/python tools/evaluate.py runs/cpu_demo/hf_final --config configs/cpu_demo.yaml
    .venv/bin/python tools/evaluate.py ~/.cache/megatron_rlhf/SmolLM2-135M-Instruct-hf \\
        --config configs/cpu_demo.yaml eval.num_prompts=128 --out base_eval.json
    # unbiased pass@1/4/8 (Chen et al. 2021) from 8 samples per prompt, with standard errors
    .venv/bin/python tools/evaluate.py runs/cpu_demo/hf_final --config configs/cpu_demo.yaml \
        eval.samples=8 "eval.pass_at_k=[1,4,8]"

The config gives the tasks (their held-out prompts: ``tasks[].eval_data`` or the fixed held-out
slice of ``tasks[].data``), the rewards (math-verify, reward model, plug-in), the sampling
settings (``generators.*``) and the eval settings (``eval.*``); ``model.source`` is ignored (the
folder given is scored). One vLLM engine (``generators.*``, engine seed ``run.seed``) on a local
Ray cluster runs the same ``trainer.evaluate.Evaluator`` the training loop runs on its generator
pool, so the numbers agree with the run's ``eval/*`` values of the same weights (greedy values
exactly up to kernel numerics; ``mean@k`` and ``pass@<k>_unbiased`` within their standard
errors). No reference model is loaded, so there is no ``kl_ref`` (``eval/kl_ref_skipped`` says so;
the trainer's eval measures it). Prints the values as JSON
(and writes them to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def evaluate_folder(model_dir: str | Path, cfg, *, step: int | None = None) -> dict:
    """Eval values (``eval/<task>/...``, ``time/eval_s``) of the HF folder ``model_dir`` under ``cfg``.

    Starts (and stops) a local Ray cluster unless one is running; every actor it starts is
    killed before it returns.

    Raises:
        ConfigError: bad tasks/rewards in ``cfg`` (named by key).
        FileNotFoundError: ``model_dir`` is not an HF folder.
    """
    import ray

    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.vllm_engine import VLLMGenerator
    from megatron_rlhf.generator.weight_sync import ObjectStoreTransport
    from megatron_rlhf.rewards import MathVerifyReward
    from megatron_rlhf.trainer import setup
    from megatron_rlhf.trainer.preflight import import_plugins
    from megatron_rlhf.trainer.evaluate import Evaluator

    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    if not cfg.eval.enabled:
        raise ConfigError("eval.enabled is false in this config: nothing to evaluate (set eval.enabled=true)")
    try:
        _, _, _, eval_by_task = setup.load_prompts(cfg, model_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from e
    plugins = import_plugins(cfg)
    folders = setup.resolve_reward_models(cfg)
    from megatron_rlhf.rewards.math_verify import default_num_workers

    math = MathVerifyReward(num_workers=default_num_workers(cfg.rewards.math_verify_workers)) if any(t.kind == "math_verify" for t in cfg.tasks) else None
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="mrlhf-evaluate-"))   # Ray's stack dumps (hang watchdog)
    head = setup.init_ray(cfg, scratch, scratch / "stacks", extra_cpus=len(set(folders.values())))
    actors = []
    try:
        rm_actors = setup.build_reward_models(cfg, folders)
        actors += list(set(rm_actors.values()))
        fns = setup.reward_fns(cfg, math, rm_actors, plugins, cfg.async_.timeout_s)
        gen = ray.remote(num_cpus=1, max_restarts=0)(VLLMGenerator).remote(
            model_dir=str(model_dir), generator_cfg=cfg.generators, dtype=cfg.model.dtype, seed=cfg.run.seed)
        actors.append(gen)
        pool = GeneratorPool([gen], transport=ObjectStoreTransport(), generator_cfg=cfg.generators,
                             timeout_s=cfg.async_.timeout_s)
        ev = Evaluator(pool, eval_by_task, {t.name: t.kind for t in cfg.tasks}, fns, cfg.eval,
                       cfg.generators.temperature)
        out = ev.evaluate(step if step is not None else -1)
        out["eval/model_dir"] = str(model_dir)
        return out
    finally:
        if math is not None:
            math.close()
        for a in actors:
            ray.kill(a)
        if head is not None:   # this call connected to (or started) the cluster: leave it as found
            ray.shutdown()
            if head:
                head.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; dotted overrides may come anywhere (before, between or after the options)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="HF model folder (a run's hf_final, a converted checkpoint, a base model)")
    ap.add_argument("--config", required=True, help="the recipe whose tasks and eval settings to use")
    ap.add_argument("--out", type=Path, default=None, help="also write the values to this JSON file")
    ap.add_argument("--step", type=int, default=None, help="value of eval/step to record (default -1)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.num_prompts=128")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.runtime import apply_process_env

    try:
        cfg = load_config(args.config, args.overrides)
        apply_process_env()
        res = evaluate_folder(args.model_dir, cfg, step=args.step)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        from megatron_rlhf.utils.atomic import write_text

        write_text(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
