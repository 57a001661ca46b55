"""Export a megatron checkpoint to a Hugging Face folder (loads in transformers and vLLM).

    python tools/convert/megatron_to_hf.py --ckpt runs/x/checkpoints/step_500 --out hf_out/ \
        [--base BASE_HF_DIR] [--dtype bfloat16] [--max-shard-size 5GB] [--dry-run]

``--ckpt`` may be a trainer checkpoint (``checkpoints/step_N``: uses ``learner/policy``), a learner
checkpoint folder, a converted checkpoint (hf_to_megatron / reshard output) or a bare megatron
dist checkpoint, saved with any TP x PP. Padded vocab rows are stripped, QKV and gate/up are
split back, a tied LM head is not stored (as HF does). config.json, tokenizer, chat template and
generation config are copied from the base model: ``--base``, else the folder recorded in the
checkpoint (learner_state.pt's layout.model_dir, or the run's config.yaml model.source).
Streams one layer at a time; only the current safetensors shard is held in memory.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from megatron_rlhf.convert import cli as _cli
    from megatron_rlhf.convert.pipeline import megatron_to_hf

    p = _cli.parser(__doc__)
    p.add_argument("--ckpt", required=True, help="checkpoint folder (see above)")
    p.add_argument("--out", required=True, help="output HF folder (new or empty)")
    p.add_argument("--base", default=None, help="base HF model folder (config, tokenizer)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="exported dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    args = p.parse_args(argv)
    return _cli.run(megatron_to_hf, args, ckpt=args.ckpt, out_dir=args.out, base=args.base,
                    dtype=args.dtype, max_shard_size=args.max_shard_size)


if __name__ == "__main__":
    sys.exit(main())
