"""VLLMGenerator on a tiny random Llama: sampling outputs, weight pushes, logprob agreement.

One engine is shared by the whole module (vLLM start-up costs seconds); tests that change its
weights compare against a transformers forward of exactly the weights they pushed.
"""

import pytest
import torch

from megatron_rlhf.config import GeneratorConfig
from megatron_rlhf.types import Prompt

# vLLM's prompt logprobs vs a transformers fp32 forward of the same weights: 7e-5 observed on
# this stack (cpu-stack.md); a different weight version differs by > 0.1.
LOGPROB_TOL = 1e-4
MAX_NEW = 12


class _Env:
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megatron_rlhf.generator import VLLMGenerator

        self.set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it by a no-op
        self.threads = torch.get_num_threads()
        cfg = GeneratorConfig(max_new_tokens=MAX_NEW, max_model_len=128, kv_cache_gib=0.0625)
        self.gen = VLLMGenerator(model_dir=str(model_dir), generator_cfg=cfg, seed=0, cpu_core=-1)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.base = {k: v.clone() for k, v in self.hf.state_dict().items()}

    def close(self):
        del self.gen
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)


@pytest.fixture(scope="module")
def env(tiny_llama_dir):
    e = _Env(tiny_llama_dir)
    yield e
    e.close()


def _prompts(tok, n=3):
    texts = ["the quick brown fox", "how many apples are left", "solve the problem one two three"]
    return [Prompt(index=i, task="t", token_ids=tuple(tok(texts[i % 3])["input_ids"]) + (i,))
            for i in range(n)]


def _hf_logprobs(model, seqs):
    """[B] lists of T floats, position t = log p(x_t | x_<t) from transformers, position 0 = 0."""
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits.float(), -1)[0]
            out.append([0.0] + [lp[t - 1, s[t]].item() for t in range(1, len(s))])
    return out


def _maxdiff(a, b):
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _perturbed(base, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in base.items()}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_generate_returns_n_completions_with_logprobs_that_match_transformers(env):
    prompts = _prompts(env.tok)
    before = env.gen.stats()
    out = env.gen.generate(prompts, n=4)
    assert len(out) == 3 and all(len(o) == 4 for o in out)
    version = env.gen.get_weight_version()
    for p, comps in zip(prompts, out):
        for c in comps:
            assert 1 <= len(c.token_ids) <= MAX_NEW and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "length") == (len(c.token_ids) == MAX_NEW and c.token_ids[-1] != env.tok.eos_token_id)
            assert c.weight_version == version
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert isinstance(c.text, str)
    # sampling logprobs (temperature 1) = transformers logprobs of the sampled tokens
    env.hf.load_state_dict(getattr(env, "gen_state", env.base))
    flat = [(p, c) for p, cs in zip(prompts, out) for c in cs]
    ref = _hf_logprobs(env.hf, [list(p.token_ids) + list(c.token_ids) for p, c in flat])
    got = [list(c.logprobs) for _, c in flat]
    assert _maxdiff(got, [r[len(p.token_ids):] for (p, _), r in zip(flat, ref)]) < LOGPROB_TOL
    # 4 samples of 3 prompts are not all the same (the engine samples, seeded once)
    assert len({c.token_ids for cs in out for c in cs}) > 1
    s = env.gen.stats()
    assert s["generator/tokens"] - before["generator/tokens"] == sum(len(c.token_ids) for cs in out for c in cs)
    assert s["generator/busy_s"] > before["generator/busy_s"] and s["generator/tokens_per_s"] > 0


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_update_weights_makes_prompt_logprobs_match_the_new_weights(env):
    prompts = _prompts(env.tok)
    seqs = [list(p.token_ids) + [5, 6, 7] for p in prompts]
    env.hf.load_state_dict(env.base)
    ref_old = _hf_logprobs(env.hf, seqs)
    new = _perturbed(env.base, seed=1)
    env.hf.load_state_dict(new)
    ref_new = _hf_logprobs(env.hf, seqs)
    # one tensor per bucket: q/k/v and gate/up (fused in vLLM) arrive in different buckets
    buckets = [{k: v} for k, v in new.items()]
    info = env.gen.update_weights(buckets, version=1)
    assert info["tensors"] == len(new) and info["bytes"] == sum(v.numel() * 4 for v in new.values())
    assert env.gen.get_weight_version() == 1
    got = env.gen.prompt_logprobs(seqs)
    assert all(r[0] == 0.0 for r in got)
    assert _maxdiff(got, ref_new) < LOGPROB_TOL
    assert _maxdiff(got, ref_old) > 0.1
    env.gen_state = new
    out = env.gen.generate(prompts[:1], n=2)
    assert all(c.weight_version == 1 for c in out[0])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_update_weights_from_ray_object_refs(env):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        new = _perturbed(env.base, seed=2)
        names = list(new)
        refs = [ray.put({k: new[k] for k in names[i:i + 4]}) for i in range(0, len(names), 4)]
        info = env.gen.update_weights(refs, version=2)
        assert info["tensors"] == len(new)
    finally:
        ray.shutdown()
    assert env.gen.get_weight_version() == 2
    seqs = [list(p.token_ids) for p in _prompts(env.tok)]
    env.hf.load_state_dict(new)
    assert _maxdiff(env.gen.prompt_logprobs(seqs), _hf_logprobs(env.hf, seqs)) < LOGPROB_TOL
    env.gen_state = new


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_bad_updates_and_prompts_raise_and_leave_the_engine_usable(env):
    version = env.gen.get_weight_version()
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="not in the checkpoint"):
        env.gen.update_weights([{"model.layers.0.mlp.nope.weight": torch.zeros(2)}], version=9)
    with pytest.raises(ValueError, match="shape"):
        env.gen.update_weights([{name: torch.zeros(2, 2)}], version=9)
    with pytest.raises(TypeError, match="ObjectRef"):
        env.gen.update_weights(["not a bucket"], version=9)
    with pytest.raises(ValueError, match="max_model_len"):
        env.gen.generate([Prompt(index=0, task="t", token_ids=tuple(range(5, 5 + 128)))], n=1)
    assert env.gen.get_weight_version() == version
    seqs = [list(p.token_ids) for p in _prompts(env.tok)]
    env.hf.load_state_dict(getattr(env, "gen_state", env.base))
    assert _maxdiff(env.gen.prompt_logprobs(seqs), _hf_logprobs(env.hf, seqs)) < LOGPROB_TOL
