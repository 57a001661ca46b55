#!/usr/bin/env python
"""Render an sbatch script from a config (its ``placement`` section) and submit it.

    # from the repo root:
    python slurm/submit.py --config configs/online-dpo-llama3.1-8b-2n8g.yaml            # submit
    python slurm/submit.py --config configs/online-dpo-llama3.1-8b-2n8g.yaml --nodes 2 \\
        model.source=/models/Llama-3.1-8B-Instruct run.name=try2                         # + overrides
    python slurm/submit.py --config configs/X.yaml --dry-run                  # print the script
    python slurm/submit.py --config configs/X.yaml --dry-run --out slurm/X.sbatch   # (re)write a
                                                                  # checked-in script, see below

What it does: loads and validates the config with the overrides (errors name the key), checks
``--nodes`` against ``placement.learner_nodes + placement.generator_nodes``, runs the per-GPU
memory estimate of ``tools/plan_memory.py`` for GPU jobs (exit 2 when it exceeds
``placement.gpu_memory_gib``, unless ``--ignore-memory``), renders the script, and (without
``--dry-run``) writes it to ``<run>/logs/submit-<time>.sbatch`` and calls ``sbatch`` with
``--output=<run>/logs/slurm-%j.out`` so that everything lands in the run folder.

The scripts in ``slurm/*.sbatch`` are this script's ``--dry-run`` output for the recipes in
``configs/`` (same name); they use the repo-relative config path and ``$SLURM_SUBMIT_DIR`` as the
repo, so ``sbatch slurm/X.sbatch [key=value ...]`` works from the repo root.
The rendered script only sets the job's resources and a few environment variables, then execs
``slurm/ray_cluster.sh`` (Ray head/workers, signal forwarding, requeue; see its header).

Exit codes: 0 submitted / printed, 1 sbatch failed, 2 bad config or memory estimate exceeded.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def render_sbatch(*, job_name: str, config_path: str, placement, overrides: list[str] | None = None,
                  repo: str | None = None, name_flag: bool = False) -> str:
    """The sbatch script text for a job.

    Args:
        job_name: ``--job-name`` (the recipe name by convention).
        config_path: the config as ``ray_cluster.sh`` should load it (repo-relative or absolute).
        placement: a :class:`megatron_rlhf.placement.PlacementConfig`.
        overrides: ``key=value`` items baked into the script (kept across requeues).
        repo: absolute repo path to bake in; ``None`` = ``$SLURM_SUBMIT_DIR`` (submit from the repo).
        name_flag: the job name differs from the config's file name (``--name`` in the re-render hint).
    Returns:
        The script, ending with a newline.
    """
    p = placement
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# {job_name}: rendered by slurm/submit.py from {config_path}; edit the config, then re-render:",
        f"#   python slurm/submit.py --config {config_path} --dry-run --out slurm/{job_name}.sbatch"
        + (f" --name {job_name}" if name_flag else ""),
        "# Submit from the repo root (extra key=value overrides are passed to train.py):",
        f"#   sbatch slurm/{job_name}.sbatch [key=value ...]",
        f"#   python slurm/submit.py --config {config_path} [key=value ...]   (logs straight into the run folder)",
        f"# Layout: {p.learner_nodes} learner node(s) + {p.generator_nodes} generator node(s)"
        + (" (shared)" if p.share_nodes else "") + f", {p.gpus_per_node} GPUs per node.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={p.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if p.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={p.gpus_per_node}")
    if p.cpus_per_node > 0:
        lines.append(f"#SBATCH --cpus-per-task={p.cpus_per_node}")
    else:
        lines.append("#SBATCH --exclusive")
    lines += [
        f"#SBATCH --time={p.time_limit}",
        f"#SBATCH --signal=B:TERM@{p.signal_lead_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=slurm-%x-%j.out",
    ]
    if p.partition:
        lines.append(f"#SBATCH --partition={p.partition}")
    if p.account:
        lines.append(f"#SBATCH --account={p.account}")
    lines += [f"#SBATCH {opt}" for opt in p.extra_sbatch]
    repo_expr = q(repo) if repo else '"$SLURM_SUBMIT_DIR"'
    lines += [
        "set -euo pipefail",
        f"export MRLHF_REPO=${{MRLHF_REPO:-{repo_expr}}}",
        'if [ ! -f "$MRLHF_REPO/slurm/ray_cluster.sh" ]; then',
        '  echo "submit from the megatron-rlhf repo root, or set MRLHF_REPO (got $MRLHF_REPO)" >&2; exit 2',
        "fi",
        f"export MRLHF_LEARNER_NODES={p.learner_nodes} MRLHF_GENERATOR_NODES={p.generator_nodes} "
        f"MRLHF_SHARE_NODES={int(p.share_nodes)}",
        f"export MRLHF_GPUS_PER_NODE={p.gpus_per_node}"
        + (f" MRLHF_CPUS_PER_NODE={p.cpus_per_node}" if p.cpus_per_node > 0 else ""),
        f"export MRLHF_RAY_PORT=${{MRLHF_RAY_PORT:-{p.ray_port}}} "
        f"MRLHF_RAY_JOIN_TIMEOUT_S={p.ray_join_timeout_s} MRLHF_DIST_TIMEOUT_S={p.dist_timeout_s}",
    ]
    if p.network_interface:
        lines.append(f"export MRLHF_NET_IFNAME=${{MRLHF_NET_IFNAME:-{p.network_interface}}}")
    baked = " ".join(q(o) for o in overrides or [])
    lines.append(f'exec bash "$MRLHF_REPO/slurm/ray_cluster.sh" {q(config_path)}'
                 + (f" {baked}" if baked else "") + ' "$@"')
    return "\n".join(lines) + "\n"


def _config_arg(path: Path) -> str:
    """Repo-relative when the config lives in the repo (portable scripts), else absolute."""
    path = path.resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def memory_check(cfg) -> tuple[bool, str]:
    """``tools/plan_memory.py``'s estimate for the config: (fits, table text)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import plan_memory
    finally:
        sys.path.pop(0)
    shape, lay, gen, mem = plan_memory.layouts_from_config(cfg)
    result = plan_memory.plan(shape, lay, gen, gpu_mem_gib=mem)
    return result["fits"], plan_memory.format_plan(result, lay, gen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="recipe YAML, e.g. configs/online-dpo-llama3.1-8b-2n8g.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (baked into the script)")
    ap.add_argument("--name", help="job (and script) name; default: the config's file name")
    ap.add_argument("--nodes", type=int, help="expected node count (checked against placement.*)")
    ap.add_argument("--dry-run", action="store_true", help="print (or --out) the script, do not submit")
    ap.add_argument("--out", help="with --dry-run: write the script here instead of printing it")
    ap.add_argument("--ignore-memory", action="store_true", help="submit even if the memory estimate exceeds the GPU")
    args = ap.parse_args(argv)

    if str(REPO) not in sys.path:  # this checkout's package, whatever else is installed
        sys.path.insert(0, str(REPO))
    from megatron_rlhf.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    p = cfg.placement
    if args.nodes is not None and args.nodes != p.num_nodes:
        print(f"--nodes {args.nodes} but the config places {p.learner_nodes} learner + {p.generator_nodes} "
              f"generator node(s) = {p.num_nodes}: pass placement.generator_nodes={args.nodes - p.learner_nodes} "
              f"(and raise generators.num_workers to fill them) or --nodes {p.num_nodes}", file=sys.stderr)
        return 2
    if p.gpus_per_node > 0:
        try:
            fits, table = memory_check(cfg)
        except ValueError as e:   # e.g. model.source=smollm2 or a folder without config.json
            print(f"memory estimate: {e} (model.source must be an HF folder with config.json; "
                  "or pass --ignore-memory)", file=sys.stderr)
            if not args.ignore_memory:
                return 2
            fits, table = True, ""
        print(table, file=sys.stderr)
        if not fits and not args.ignore_memory:
            print("memory estimate exceeds placement.gpu_memory_gib: change the layout or pass --ignore-memory",
                  file=sys.stderr)
            return 2
    job_name = args.name or Path(args.config).stem
    name_flag = job_name != Path(args.config).stem
    if args.dry_run:
        text = render_sbatch(job_name=job_name, config_path=_config_arg(Path(args.config)),
                             placement=p, overrides=args.overrides, name_flag=name_flag)
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    logs = cfg.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    text = render_sbatch(job_name=job_name, config_path=str(Path(args.config).resolve()), placement=p,
                         overrides=args.overrides, repo=str(REPO), name_flag=name_flag)
    script = logs / f"submit-{_dt.datetime.now():%Y%m%d-%H%M%S}.sbatch"
    script.write_text(text)
    cmd = ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={logs}/slurm-%j.out", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"sbatch failed ({res.returncode}): {res.stderr.strip()}", file=sys.stderr)
        return 1
    job = res.stdout.strip().split(";")[0]
    print(f"submitted job {job}: {script}; logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
