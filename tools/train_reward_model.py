#!/usr/bin/env python
"""Train a Bradley-Terry reward model on preference pairs, on CPU in a few minutes (CLI).

    python tools/train_reward_model.py --out runs/rm_smollm2     # the CPU demo's reward model (defaults
        # below: SmolLM2-135M-Instruct cut to 2 layers, every training pair, 500 held out, 64 tokens, seed 0)
    python tools/train_reward_model.py --out DIR --base PATH_TO_HF_MODEL --train-pairs 4000 \\
        --eval-pairs 1000 --max-len 256 --layers 0 --feature-layers 12,24 --pooling last,reply_mean

A thin command line over ``megatron_rlhf.rewards.train.train_reward_model``; its module docstring
says what training does (frozen trunk + linear Bradley-Terry head on cached features, L2 by
group-wise CV, held-out accuracy with its standard error, atomic output folder). The run config's
``tasks[].reward: {reward_model: smollm2-demo}`` builds the same default model on first use
(``megatron_rlhf.rewards.resolve_reward_model``) into ``~/.cache/megatron_rlhf/reward_models/smollm2-L2-T64``.
``--no-*`` flags drop features. Output folder: the trunk + tokenizer, ``reward_head.json``,
``reward_head.safetensors`` and ``rm_report.json`` (n, accuracy, s.e., per-source baselines, timings).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rlhf.rewards.train import (DEFAULT_DATA, DEFAULTS, _sha256_file, accuracy_se,  # noqa: F401
                                         build_pairs, cache_key, choose_weight_decay, extract_features,
                                         fit_head, reload_check, resolve_base, train_reward_model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--base", default="smollm2", help="'smollm2' (packaged SmolLM2-135M-Instruct) or an HF folder")
    ap.add_argument("--data", nargs="+", default=None,
                    help=f"preference files or folders (default {DEFAULT_DATA})")
    ap.add_argument("--sources", default="", help="comma list of formats to keep (hh_rlhf,dove,alpaca_eval); default all")
    ap.add_argument("--train-pairs", type=int, default=DEFAULTS["train_pairs"], help="0 = every pair not held out")
    ap.add_argument("--eval-pairs", type=int, default=DEFAULTS["eval_pairs"])
    ap.add_argument("--max-len", type=int, default=DEFAULTS["max_len"], help="tokens per sequence (cut from the left)")
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="keep the first N transformer layers (0 = all)")
    ap.add_argument("--feature-layers", default=",".join(map(str, DEFAULTS["feature_layers"])),
                    help="comma list of hidden states read (0 = embeddings, N = after N layers; the last is "
                         "the normed output); 'none' = no transformer layer")
    ap.add_argument("--pooling", default=",".join(DEFAULTS["poolings"]), help="comma subset of last,reply_mean")
    ap.add_argument("--no-reply-embedding", action="store_true", help="no mean input embedding of the whole reply")
    ap.add_argument("--no-length-feature", action="store_true", help="no log(1 + reply tokens)")
    ap.add_argument("--no-length-x-prompt", action="store_true",
                    help="no log(1 + reply tokens) x mean input embedding of the prompt")
    ap.add_argument("--half", default="", choices=["", "a", "b"],
                    help="train on one of two halves of the training pairs that share no prompt (a proxy "
                         "reward model on a, an evaluation one on b); default all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default="~/.cache/megatron_rlhf", help="base model + feature cache")
    ap.add_argument("--feature-cache-dir", default=None,
                    help="where trunk features are cached (default CACHE_DIR/rm_features)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    a = ap.parse_args(argv)
    try:
        fl = () if a.feature_layers.strip() == "none" else tuple(int(x) for x in a.feature_layers.split(",") if x.strip())
        rep = train_reward_model(
            out=a.out, base=a.base, data=a.data, train_pairs=a.train_pairs, eval_pairs=a.eval_pairs,
            max_len=a.max_len, layers=a.layers, feature_layers=fl,
            poolings=tuple(x.strip() for x in a.pooling.split(",") if x.strip()),
            reply_embedding_mean=not a.no_reply_embedding, length_feature=not a.no_length_feature,
            length_x_prompt_embedding=not a.no_length_x_prompt, sources=tuple(x.strip() for x in a.sources.split(",") if x.strip()),
            half=a.half, seed=a.seed, cache_dir=a.cache_dir, feature_cache_dir=a.feature_cache_dir, batch_size=a.batch_size,
            threads=a.threads)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[rm] held-out pairwise accuracy {rep['accuracy']:.3f} +- {rep['se']:.3f} (s.e.), n={rep['n_eval']} "
          f"({rep['chance_z']:.1f} s.e. above chance; 'longer reply wins' baseline "
          f"{rep['baseline_longer_reply_wins']:.3f}); train acc {rep['train_accuracy']:.3f}; per source "
          f"{json.dumps({k: round(v['accuracy'], 3) for k, v in rep['eval_by_source'].items()})}")
    print(f"[rm] saved {rep['out']} (report rm_report.json); times {rep['time_s']}; serving check: "
          f"features {rep['reload_check_feature_max_abs_diff']:.2e}, rewards {rep['reload_check_max_abs_diff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
