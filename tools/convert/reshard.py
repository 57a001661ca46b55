"""Rewrite a megatron model checkpoint for another TP x PP layout.

    python tools/convert/reshard.py --ckpt CKPT --out CKPT2 --tp 2 --pp 4 [--base HF_DIR] [--dry-run]

Reads any checkpoint megatron_to_hf.py accepts; writes the converted format of
hf_to_megatron.py (``CKPT2/policy`` + ``mrlhf_checkpoint.json`` + config/tokenizer). Values are
copied bit for bit; vocab padding is recomputed for the new TP; chunks follow the new TP split.
Validates that TP divides heads / KV groups / FFN and PP the layers. Only the model is
resharded (not a learner checkpoint's optimizer state). Streams one layer at a time.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from megatron_rlhf.convert import cli as _cli
    from megatron_rlhf.convert.pipeline import reshard

    p = _cli.parser(__doc__)
    p.add_argument("--ckpt", required=True, help="input checkpoint folder")
    p.add_argument("--out", required=True, help="output checkpoint folder (new or empty)")
    p.add_argument("--tp", type=int, required=True, help="new tensor parallel size")
    p.add_argument("--pp", type=int, required=True, help="new pipeline parallel size")
    p.add_argument("--base", default=None, help="base HF model folder (config, tokenizer)")
    args = p.parse_args(argv)
    return _cli.run(reshard, args, ckpt=args.ckpt, out_dir=args.out, tp=args.tp, pp=args.pp,
                    base=args.base)


if __name__ == "__main__":
    sys.exit(main())
