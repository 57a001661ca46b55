"""Convert a Hugging Face model folder to a megatron-core dist checkpoint for a TP x PP layout.

    python tools/convert/hf_to_megatron.py --hf DIR --out CKPT --tp 8 --pp 2 [--dtype bfloat16] [--dry-run]

Supports Llama 3.x (incl. SmolLM2), Qwen2/2.5, Qwen3 and Mistral (tied or untied embeddings,
GQA). Validates that TP divides the heads, KV groups and FFN width and PP the layers; pads the
vocab with zero rows to a multiple of TP; streams one tensor at a time (safetensors memory maps,
no full second copy of the model); no torch.distributed needed. Output::

    CKPT/policy/                 megatron dist_checkpointing (torch_dist): loads into any TP x PP
                                 GPTModel whose TP divides the padded vocab
    CKPT/mrlhf_checkpoint.json   layout (tp, pp, padded_vocab_size, model_type, dtype, source)
    CKPT/config.json, tokenizer*, generation_config.json   copied from the HF folder

Load it into a megatron model with ``megatron_rlhf.convert.dist_ckpt.load_model_from_checkpoint``;
reshard with tools/convert/reshard.py; export with tools/convert/megatron_to_hf.py.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from megatron_rlhf.convert import cli as _cli
    from megatron_rlhf.convert.pipeline import hf_to_megatron

    p = _cli.parser(__doc__)
    p.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output checkpoint folder (new or empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="stored dtype (default: the HF checkpoint's)")
    args = p.parse_args(argv)
    return _cli.run(hf_to_megatron, args, hf_dir=args.hf, out_dir=args.out, tp=args.tp,
                    pp=args.pp, dtype=args.dtype)


if __name__ == "__main__":  # guard: dist_checkpointing / multiprocessing spawn re-imports __main__
    sys.exit(main())
