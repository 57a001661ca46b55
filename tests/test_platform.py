"""The CPU platform shims (megatron_rlhf.platform): each one does what it claims, and only that."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.platform import get_platform

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims are inactive with CUDA")


@pytest.fixture
def cpu_mod():
    """The platform.cpu module; restores the install state it found."""
    from megatron_rlhf.platform import cpu

    was, mode = cpu.is_installed(), cpu.function_mode_active()
    yield cpu
    cpu.uninstall()
    if was:
        cpu.install(function_mode=mode)


@pytest.fixture
def groups():
    from megatron_rlhf.learner import parallel

    get_platform().install(function_mode=False)
    g = parallel.acquire(backend="gloo")
    yield g
    parallel.release()


@pytest.mark.timeout(30)
def test_get_platform_is_cpu_gloo_without_cuda_and_refuses_forced_cuda():
    p = get_platform()
    assert (p.device, p.dist_backend, p.is_cpu) == ("cpu", "gloo", True)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        get_platform("cuda")
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda'"):
        get_platform("tpu")


@pytest.mark.timeout(30)
def test_install_is_idempotent_and_uninstall_restores_torch(cpu_mod):
    cpu_mod.uninstall()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()  # CPU torch: "Torch not compiled with CUDA enabled"
    assert cpu_mod.install() is True
    first = torch.cuda.current_device
    assert cpu_mod.install() is True  # second call changes nothing
    assert torch.cuda.current_device is first
    cpu_mod.uninstall()
    assert not cpu_mod.is_installed() and not cpu_mod.function_mode_active()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


@pytest.mark.timeout(30)
def test_without_function_mode_only_current_device_and_synchronize_are_patched(cpu_mod):
    cpu_mod.uninstall()
    cpu_mod.install(function_mode=False)
    assert torch.cuda.current_device() == torch.device("cpu") and not cpu_mod.function_mode_active()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # device literals are not rewritten
    cpu_mod.install()  # adds the mode later
    assert cpu_mod.function_mode_active() and torch.zeros(1, device="cuda").device.type == "cpu"


@pytest.mark.timeout(30)
def test_cuda_rng_state_is_an_empty_placeholder_and_megatron_checkpoint_restores_the_cpu_generator(cpu_mod):
    from megatron.core.tensor_parallel.random import _set_cuda_rng_state, checkpoint

    cpu_mod.uninstall()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.get_rng_state()
    cpu_mod.install(function_mode=False)
    assert torch.cuda.get_rng_state().numel() == 0 and torch.cuda.random.get_rng_state().numel() == 0
    _set_cuda_rng_state(torch.cuda.get_rng_state())   # megatron's restore: queued, never run on CPU
    # activation checkpointing with dropout: backward recomputes the same mask (CPU generator)
    x = torch.randn(64, requires_grad=True)
    fn = lambda t: torch.nn.functional.dropout(t, 0.5, training=True) * 3   # noqa: E731
    torch.manual_seed(1)
    checkpoint(fn, False, x).sum().backward()
    torch.manual_seed(1)
    x2 = x.detach().clone().requires_grad_(True)
    fn(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and (x.grad == 0).any()
    cpu_mod.uninstall()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.get_rng_state()


@pytest.mark.timeout(30)
def test_recompute_overrides_per_platform():
    from megatron_rlhf.platform import Platform

    cpu = get_platform("cpu")
    assert cpu.recompute_overrides("none", ["core_attn"]) == {}
    assert cpu.recompute_overrides("selective", ["core_attn", "mlp"]) == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
    assert cpu.recompute_overrides("full", [])["recompute_granularity"] == "full"
    with pytest.raises(ValueError, match="none, full or selective"):
        cpu.recompute_overrides("block", [])
    gpu = Platform(device="cuda", dist_backend="nccl")   # only the TE check runs; no CUDA call
    from megatron_rlhf.platform import gpu as gpu_mod

    if gpu_mod.have_transformer_engine():
        with pytest.raises(ValueError, match="core_attn"):
            gpu.recompute_overrides("selective", ["core_attn"])
    else:
        assert gpu.recompute_overrides("selective", ["core_attn"])["recompute_modules"] == ["core_attn"]
    assert gpu.recompute_overrides("selective", ["mlp"])["recompute_modules"] == ["mlp"]


@pytest.mark.timeout(30)
def test_current_device_is_cpu_and_synchronize_is_noop(cpu_mod):
    cpu_mod.install()
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.synchronize() is None
    t = torch.arange(4, device=torch.cuda.current_device())  # what RoPE/DDP buffers do
    assert t.device.type == "cpu"


@pytest.mark.timeout(30)
def test_function_mode_maps_cuda_device_literals_to_cpu(cpu_mod):
    cpu_mod.install()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device="cuda:0").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda")).device.type == "cpu"
    assert torch.full((2,), 1.0, device=0).device.type == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to("cuda", torch.float64).dtype == torch.float64
    assert torch.zeros(2, device="cpu").device.type == "cpu"  # untouched


@pytest.mark.timeout(30)
def test_type_spoof_and_device_mapping_are_scoped_to_the_optimizer_context(cpu_mod):
    cpu_mod.uninstall()
    cpu_mod.install(function_mode=False)
    x = torch.ones(2)
    assert x.type() == "torch.FloatTensor"
    with get_platform().optimizer_context():
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.double().type() == "torch.cuda.DoubleTensor"
        assert x.type(torch.float64).dtype == torch.float64  # conversions are not spoofed
        assert torch.zeros(1, dtype=torch.int, device="cuda").device.type == "cpu"  # clip_grads
    assert x.type() == "torch.FloatTensor"


def _tiny_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                normalization="RMSNorm", use_cpu_initialization=True, hidden_dropout=0.0,
                attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                persist_layer_norm=False, apply_rope_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.timeout(60)
def test_sdpa_core_attention_matches_explicit_causal_gqa_softmax(groups):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rlhf.platform.cpu import SDPACoreAttention

    cfg = _tiny_config()
    attn = SDPACoreAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self", pg_collection=groups.pg_collection)
    sq, b, np_, ng, hn = 7, 2, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, b, np_, hn, generator=g)
    k = torch.randn(sq, b, ng, hn, generator=g)
    v = torch.randn(sq, b, ng, hn, generator=g)
    out = attn(q, k, v, attention_mask=None)
    assert out.shape == (sq, b, np_ * hn)
    # reference: query head h uses KV group h // (np/ng); causal softmax(q k^T / sqrt(hn)) v
    kk, vv = k.repeat_interleave(np_ // ng, dim=2), v.repeat_interleave(np_ // ng, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / hn ** 0.5
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1)
    ref = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(causal, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, ref.reshape(sq, b, np_ * hn), atol=1e-5, rtol=1e-5)
    # explicit megatron mask (True = masked) gives the same result as the causal flag
    out_mask = attn(q, k, v, attention_mask=causal.view(1, 1, sq, sq))
    torch.testing.assert_close(out_mask, out, atol=1e-6, rtol=1e-6)


@pytest.mark.timeout(30)
def test_cpu_norm_is_torch_rmsnorm_or_layernorm_and_accepts_sequence_parallel():
    from megatron_rlhf.platform.cpu import CPUNorm

    norm = CPUNorm(_tiny_config(), 64, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm)
    x = torch.randn(3, 64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-6)
    ln = CPUNorm(_tiny_config(normalization="LayerNorm"), 64)
    assert isinstance(ln, torch.nn.LayerNorm)
    sp = CPUNorm(_tiny_config(sequence_parallel=True, tensor_model_parallel_size=2), 64)
    assert all(p.sequence_parallel for p in sp.parameters())


@pytest.mark.timeout(60)
def test_cpu_layer_spec_uses_sdpa_attention_and_cpu_norms(groups):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_rlhf.platform.cpu import CPUNorm, SDPACoreAttention

    spec = get_platform().layer_spec(_tiny_config())
    assert spec.module is TransformerBlock
    layers = spec.submodules.layer_specs
    assert len(layers) == 2 and spec.submodules.layer_norm is CPUNorm
    sub = layers[0].submodules
    assert sub.self_attention.submodules.core_attention is SDPACoreAttention
    assert sub.input_layernorm is CPUNorm and sub.pre_mlp_layernorm is CPUNorm
    # checkpoint names stay in the TE layout (so GPU runs can load CPU checkpoints)
    assert sub.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"


_FAKE_TE_PROBE = r"""
import importlib, json, sys
from pathlib import Path
from megatron_rlhf.platform import Platform, gpu
out = {"absent": gpu.have_transformer_engine()}
root = Path(sys.argv[1])
(root / "transformer_engine" / "pytorch").mkdir(parents=True)
(root / "transformer_engine" / "__init__.py").write_text("__version__ = '2.20.2'\n")
(root / "transformer_engine" / "pytorch" / "__init__.py").write_text("")   # no fp8 module
(root / "transformer_engine" / "pytorch" / "tensor").mkdir()   # megatron's fp8_utils needs it
(root / "transformer_engine" / "pytorch" / "tensor" / "__init__.py").write_text("class QuantizedTensor: pass\n")
meta = root / "transformer_engine-2.20.2.dist-info"
meta.mkdir()
(meta / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer-engine\nVersion: 2.20.2\n")
sys.path.insert(0, str(root))
importlib.invalidate_caches()
import transformer_engine.pytorch   # what the old check accepted
cuda = Platform(device="cuda", dist_backend="nccl")   # no CUDA call is made below
for name, call in (("check", gpu.have_transformer_engine),
                   ("layer_spec", lambda: cuda.layer_spec(None)),
                   ("recompute", lambda: cuda.recompute_overrides("selective", ["mlp"]))):
    try:
        call()
        out[name] = "no error"
    except gpu.TransformerEngineMismatch as e:
        out[name] = str(e)
from megatron.core.extensions import transformer_engine as mte
out["megatron_have_te"] = mte.HAVE_TE
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_transformer_engine_that_megatron_mocks_raises_naming_versions_and_fix(tmp_path):
    """A ``transformer_engine`` whose ``pytorch`` package imports but which megatron's TE extension
    cannot load (no ``transformer_engine.pytorch.fp8``, as with a TE outside megatron-core's range):
    megatron sets HAVE_TE=False and mocks ``te``; the platform's check, the GPU layer spec and the
    recompute check all raise, naming TE 2.20.2, megatron-core 0.16.1 and the fix. Without any
    ``transformer_engine`` the check says False (the device-agnostic spec)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(repo)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    res = subprocess.run([sys.executable, "-c", _FAKE_TE_PROBE, str(tmp_path / "site")], env=env,
                         capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["absent"] is False and out["megatron_have_te"] is False
    for key in ("check", "layer_spec", "recompute"):
        msg = out[key]
        assert "transformer_engine 2.20.2" in msg and "megatron-core 0.16.1" in msg, msg
        assert "fp8" in msg and ">=2.9,<2.12" in msg and "uninstall transformer-engine" in msg, msg


def test_micro_batch_length_multiple_defaults_to_64_on_gpu_tp_on_cpu_and_stays_a_multiple_of_tp():
    from megatron_rlhf.platform import micro_batch_length_multiple as m

    assert m(0, cuda=True, tp=1, sequence_parallel=False) == 64
    assert m(0, cuda=True, tp=8, sequence_parallel=True) == 64
    assert m(0, cuda=False, tp=2, sequence_parallel=True) == 2
    assert m(0, cuda=False, tp=1, sequence_parallel=False) == 1
    assert m(48, cuda=True, tp=32, sequence_parallel=True) == 96      # lcm(48, 32)
    assert m(48, cuda=True, tp=32, sequence_parallel=False) == 48
    with pytest.raises(ValueError, match="seq_length_multiple"):
        m(-1, cuda=True, tp=1, sequence_parallel=False)


def test_learner_rounds_micro_batch_lengths_to_the_configured_multiple():
    """The learner's plans (token_logprobs, train_step) pad each micro-batch to the multiple."""
    from types import SimpleNamespace

    from megatron_rlhf.config import LearnerConfig
    from megatron_rlhf.learner.actor import MegatronLearner

    fake = SimpleNamespace(cfg=LearnerConfig(micro_batch_size=2, seq_length_multiple=16, pack_sequences=False),
                           platform=get_platform("cpu"), groups=SimpleNamespace(tp=1, dp=1),
                           sequence_parallel=False)
    fake._pad_multiple = lambda: MegatronLearner._pad_multiple(fake)
    plans = MegatronLearner._plans(fake, [5, 17, 30, 33])
    assert sorted(mb.seq_len for mb in plans[0]) == [32, 48]
    fake.cfg = LearnerConfig(micro_batch_size=2, pack_sequences=False)
    assert sorted(mb.seq_len for mb in MegatronLearner._plans(fake, [5, 17, 30, 33])[0]) == [17, 33]
    fake.cfg = LearnerConfig(micro_batch_size=2, seq_length_multiple=16)   # packed: the row of both, rounded
    assert sorted(mb.packed_len for mb in MegatronLearner._plans(fake, [5, 17, 30, 33])[0]) == [32, 64]


def test_transformer_fields_per_platform_and_te_needs_cuda():
    from megatron_rlhf.platform import CUDA_ONLY_FIELDS, transformer_fields

    assert transformer_fields(cuda=False, te=False) == {"use_cpu_initialization": True}
    gpu = transformer_fields(cuda=True, te=False)
    assert gpu == {"use_cpu_initialization": False, "bias_activation_fusion": True, "apply_rope_fusion": False,
                   "gradient_accumulation_fusion": False,
                   "batch_p2p_sync": False}   # review 2, N9: no device-wide sync after each pipeline p2p
    assert transformer_fields(cuda=True, te=True)["apply_rope_fusion"] is True
    assert transformer_fields(cuda=True, te=True, wgrad_kernel=True)["gradient_accumulation_fusion"] is True
    # batch_p2p_sync=False runs on CPU as well (it removes a sync): not a CUDA-only field
    assert set(CUDA_ONLY_FIELDS) == {k for k, v in gpu.items() if k not in ("use_cpu_initialization", "batch_p2p_sync")}
    with pytest.raises(ValueError, match="Transformer Engine needs CUDA"):
        transformer_fields(cuda=False, te=True)


@pytest.mark.timeout(30)
def test_gradient_accumulation_fusion_is_on_only_with_cuda_te_and_the_apex_wgrad_kernel_and_off_on_cpu():
    """Review 2, N8: the fusion writes every linear layer's weight gradient into DDP's fp32
    ``main_grad`` inside the wgrad GEMM. TE's linears do it themselves; GPTModel's output layer is a
    megatron ``ColumnParallelLinear`` that refuses the flag without APEX's kernel, so both are needed."""
    import itertools

    from megatron_rlhf.platform import get_platform, grad_accumulation_fusion, transformer_fields

    table = {(cuda, te, k): grad_accumulation_fusion(cuda=cuda, te=te, wgrad_kernel=k)
             for cuda, te, k in itertools.product((False, True), repeat=3)}
    assert [key for key, on in table.items() if on] == [(True, True, True)]
    assert "gradient_accumulation_fusion" not in transformer_fields(cuda=False, te=False, wgrad_kernel=True)
    assert transformer_fields(cuda=True, te=True, wgrad_kernel=False)["gradient_accumulation_fusion"] is False
    assert get_platform("cpu").fused_wgrad_kernel is False   # never imports the CUDA extension on CPU


# ------------------------------------------------------------------ peak table (review 2, N12)
@pytest.mark.timeout(30)
def test_peak_table_matches_h100_nvl_and_gb200_before_their_shorter_names_and_no_entry_is_shadowed():
    """``"NVIDIA H100 NVL"`` used to match ``H100`` (989.4 instead of the NVL's dense 835.6) and
    ``"NVIDIA GB200"`` matched ``B200`` (2250 instead of 2500); and no entry of the table may be
    unreachable because an earlier, shorter key is a substring of it."""
    from megatron_rlhf.platform.peaks import PEAK_TFLOPS, peak_tflops

    assert peak_tflops("NVIDIA H100 NVL", "bfloat16") == pytest.approx(835.6)
    assert peak_tflops("NVIDIA GB200", "bf16") == pytest.approx(2500.0)
    assert peak_tflops("NVIDIA B200", "bf16") == pytest.approx(2250.0)
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H200 NVL", "bfloat16") == pytest.approx(835.6)
    keys = [k for k, _ in PEAK_TFLOPS]
    shadowed = [(keys[i], keys[j]) for i in range(len(keys)) for j in range(i + 1, len(keys)) if keys[i] in keys[j]]
    assert not shadowed, f"(earlier key, later key it hides): {shadowed}"


@pytest.mark.timeout(30)
def test_gpu_platform_picks_local_rank_modulo_devices_and_round_trips_device_rng_state(monkeypatch):
    """The GPU branches of ``Platform.select_local_device`` / ``device_rng_state`` /
    ``set_device_rng_state`` (the learner's only CUDA device calls), with torch.cuda stood in: rank
    LOCAL_RANK=5 on a 4-GPU node takes device 1; the saved states are every device's and are
    handed back unchanged; a CPU-written checkpoint (None) leaves the device generators alone. The
    CPU platform makes none of these calls."""
    from megatron_rlhf.platform import Platform

    calls = []
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: calls.append(("set_rng", s)))
    monkeypatch.setenv("LOCAL_RANK", "5")
    gpu = Platform(device="cuda", dist_backend="nccl")
    gpu.select_local_device()
    saved = gpu.device_rng_state()
    gpu.set_device_rng_state(saved)
    gpu.set_device_rng_state(None)
    assert calls[0] == ("set_device", 1)
    assert calls[1][0] == "set_rng" and len(calls[1][1]) == 2
    assert all(torch.equal(a, b) for a, b in zip(calls[1][1], states))
    assert len(calls) == 2

    calls.clear()
    cpu = Platform(device="cpu", dist_backend="gloo")
    cpu.select_local_device()
    assert cpu.device_rng_state() is None
    cpu.set_device_rng_state(saved)
    assert calls == []
