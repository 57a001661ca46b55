"""HF <-> megatron conversion: exact round trips, the QKV/SwiGLU layouts, and megatron logits
equal to transformers logits (the ground truth) on tiny Llamas and on the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.convert import (gpt_model_kwargs_from_hf, hf_to_mcore, mcore_to_hf,
                                   transformer_config_from_hf)
from megatron_rlhf.learner.model import (build_gpt_model, full_mcore_state, load_hf_config,
                                         load_hf_state_dict, load_mcore_state)
from megatron_rlhf.platform import get_platform


def _megatron_model(model_dir, groups):
    cfg = load_hf_config(model_dir)
    tcfg = transformer_config_from_hf(cfg, dtype="float32", perform_initialization=False)
    model = build_gpt_model(cfg, tcfg, platform=get_platform(), pg_collection=groups.pg_collection)
    load_mcore_state(model, hf_to_mcore(load_hf_state_dict(model_dir), cfg))
    return model.eval(), cfg


def _max_logit_diff(model_dir, groups, input_ids) -> float:
    from transformers import AutoModelForCausalLM

    model, _ = _megatron_model(model_dir, groups)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        ours = model(input_ids=input_ids, position_ids=pos, attention_mask=None)  # [B, S, V]
        ref = hf(input_ids).logits
    assert ours.shape == ref.shape
    return (ours - ref).abs().max().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_megatron_to_hf_round_trip_is_bit_identical(tied, tiny_llama_dir, tiny_llama_tied_dir):
    model_dir = tiny_llama_tied_dir if tied else tiny_llama_dir
    cfg = load_hf_config(model_dir)
    hf = load_hf_state_dict(model_dir)  # exactly the checkpoint's tensors (no tied lm_head)
    assert ("lm_head.weight" in hf) is not tied
    mc = hf_to_mcore(hf, cfg)
    assert ("output_layer.weight" in mc) is not tied
    back = mcore_to_hf(mc, cfg)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.timeout(60)
def test_qkv_is_interleaved_per_query_group_and_fc1_is_gate_then_up(tiny_llama_dir):
    cfg = load_hf_config(tiny_llama_dir)  # 4 heads, 2 KV heads, head_dim 32
    hf = load_hf_state_dict(tiny_llama_dir)
    hn, h = 32, cfg.hidden_size
    q = torch.arange(4 * hn).repeat_interleave(h).view(4 * hn, h).float()      # row id
    k = (1000 + torch.arange(2 * hn)).repeat_interleave(h).view(2 * hn, h).float()
    v = (2000 + torch.arange(2 * hn)).repeat_interleave(h).view(2 * hn, h).float()
    hf.update({"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
               "model.layers.0.self_attn.v_proj.weight": v})
    qkv = hf_to_mcore(hf, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0]
    expect = torch.cat([torch.arange(0, 2 * hn), 1000 + torch.arange(0, hn), 2000 + torch.arange(0, hn),
                        torch.arange(2 * hn, 4 * hn), 1000 + torch.arange(hn, 2 * hn),
                        2000 + torch.arange(hn, 2 * hn)]).float()
    assert torch.equal(qkv, expect)  # [q0 q1 k0 v0 | q2 q3 k1 v1]
    fc1 = hf_to_mcore(hf, cfg)["decoder.layers.0.mlp.linear_fc1.weight"]
    ffn = cfg.intermediate_size
    assert torch.equal(fc1[:ffn], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[ffn:], hf["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.timeout(60)
def test_vocab_padding_pads_with_zero_rows_and_export_truncates(tiny_llama_dir):
    cfg = load_hf_config(tiny_llama_dir)
    hf = load_hf_state_dict(tiny_llama_dir)
    padded = cfg.vocab_size + 13
    mc = hf_to_mcore(hf, cfg, padded_vocab_size=padded)
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape[0] == padded and emb[cfg.vocab_size:].abs().sum() == 0
    assert mc["output_layer.weight"].shape[0] == padded
    back = mcore_to_hf(mc, cfg)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.timeout(60)
def test_transformer_config_from_hf_maps_llama_fields(tiny_llama_dir):
    cfg = load_hf_config(tiny_llama_dir)
    t = transformer_config_from_hf(cfg, dtype="float32")
    assert (t.num_layers, t.hidden_size, t.ffn_hidden_size) == (2, 128, 256)
    assert (t.num_attention_heads, t.num_query_groups, t.kv_channels) == (4, 2, 32)
    assert t.normalization == "RMSNorm" and t.layernorm_epsilon == cfg.rms_norm_eps
    assert t.gated_linear_unit and t.activation_func is torch.nn.functional.silu
    assert not t.add_bias_linear and not t.add_qkv_bias and t.params_dtype == torch.float32
    kw = gpt_model_kwargs_from_hf(cfg)
    assert kw["position_embedding_type"] == "rope" and kw["rotary_base"] == 10000.0
    assert kw["vocab_size"] == cfg.vocab_size and kw["share_embeddings_and_output_weights"] is False


@pytest.mark.timeout(30)
def test_unsupported_architecture_or_bias_raises_naming_the_field(tiny_llama_dir):
    cfg = load_hf_config(tiny_llama_dir)
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf_to_mcore({}, cfg)
    cfg = load_hf_config(tiny_llama_dir)
    cfg.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        transformer_config_from_hf(cfg)
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf = load_hf_state_dict(tiny_llama_dir)
        del hf["model.norm.weight"]
        hf_to_mcore(hf, load_hf_config(tiny_llama_dir))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_megatron_logits_equal_transformers_logits_fp32(tied, tiny_llama_dir, tiny_llama_tied_dir, groups):
    model_dir = tiny_llama_tied_dir if tied else tiny_llama_dir
    vocab = load_hf_config(model_dir).vocab_size
    ids = torch.randint(0, vocab, (3, 48), generator=torch.Generator().manual_seed(1))
    assert _max_logit_diff(model_dir, groups, ids) <= 1e-4


@pytest.mark.timeout(120)
def test_export_of_loaded_model_reproduces_the_checkpoint(tiny_llama_tied_dir, groups):
    model, cfg = _megatron_model(tiny_llama_tied_dir, groups)
    back = mcore_to_hf(full_mcore_state(model), cfg)
    hf = load_hf_state_dict(tiny_llama_tied_dir)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_smollm2_megatron_logits_equal_transformers_logits(tmp_path_factory, groups):
    from transformers import AutoTokenizer

    from megatron_rlhf.convert.gguf import ensure_smollm2_hf

    model_dir = ensure_smollm2_hf(tmp_path_factory.mktemp("smollm2_cache"))
    assert ensure_smollm2_hf(model_dir.parent) == model_dir  # cached: no second conversion
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.chat_template, "chat template lost in the GGUF -> HF conversion"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7? Answer briefly."}],
                                   tokenize=False, add_generation_prompt=True) + "12 * 7 = 84."
    ids = torch.tensor([tok(text)["input_ids"]])
    diff = _max_logit_diff(Path(model_dir), groups, ids)
    print(f"SmolLM2 max |megatron - transformers| logit diff: {diff:.2e} over {ids.shape[1]} tokens")
    assert diff <= 1e-4
