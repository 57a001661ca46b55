"""Per-GPU memory plan of a megatron-rlhf layout: learner GPUs and vLLM generator GPUs.

The arithmetic behind ``tools/plan_memory.py`` (the table and its exit code; ``slurm/submit.py``
runs it before submitting) and behind the run's weight-sync staging decision (:func:`learner_plan_bytes`,
``trainer/setup.py``). Pure Python: no torch, no device; the model shape comes from a preset or
an HF ``config.json``. Of the package it imports only ``platform`` (``engine_args``, the engine's
memory) and ``sync`` (``staging``, the staging rule).

Notation: P parameters, h hidden size, L layers, a = query heads, k = KV heads, d = head dim,
hq = a*d, hkv = k*d, f = FFN (SwiGLU) size, V vocab padded as Megatron pads it (to a multiple of
128*TP), t = learner TP, p = PP, D = DP, b = micro-batch (sequences), s = sequence length
(prompt + completion), g = vLLM TP. Sizes are bytes; GiB = 2**30 bytes.

Parameters (one Llama/Qwen2 decoder layer; norms are RMSNorm with one weight vector)::

    attention   = h*hq + 2*h*hkv + hq*h  (+ hq + 2*hkv QKV bias, Qwen2)
    mlp         = 3*h*f                  (gate, up, down)
    norms       = 2*h
    embedding   = V*h;  output layer = V*h (untied; tied models keep a copy on the last PP stage
                  when p > 1, as Megatron does); final norm = h

Learner GPU, per pipeline stage (L/p layers; stage 0 also holds the embedding, the last stage
the final norm and output layer). TP divides every matrix and bias by t; norms are replicated.
Per-stage parameters P_s. Bytes per parameter follow Megatron-LM's distributed-optimizer table
(docs/source/api-guide/dist_optimizer.md, "bf16 param, fp32 grads": 18 bytes, or 6 + 12/D with
the distributed optimizer)::

    policy weights   = 2 * P_s                          (bf16)
    gradients        = 4 * P_s                          (fp32 main grads, Megatron DDP)
    optimizer state  = 12 * P_s        (fp32 master copy + Adam m + Adam v)
                     = 12 * P_s / D    with the distributed optimizer (sharded over DP)
    reference model  = 2 * P_s                          (bf16, frozen, same sharding; --no-reference: 0)

Activations kept for backward, per layer and micro-batch, bf16, with sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
sec. 4, counted tensor by tensor for a Llama layer: no dropout, flash attention so no s*s
score matrix)::

    A_layer = s*b/t * (8h + 4hq + 4hkv + 6f)
      8h    : RMSNorm inputs (2) and the linear inputs they produce (2), 2 bytes each
      4hq+4hkv : Q, K, V after RoPE (flash-attention inputs) + attention output (o_proj input)
      6f    : fc1 output [gate, up] (SwiGLU input, 2f) + SwiGLU output (fc2 input, f)

Without sequence parallelism the 8h term is not divided by t. That count holds for fused
attention (Transformer Engine, or SDPA dispatching to FlashAttention: what the learner's spec
builds on CUDA without TE). Unfused attention (``--attention unfused``: megatron's
``DotProductAttention``, or SDPA's math kernel) also keeps the score matrix per layer::

    A_attn = b * (a/t) * s * s * 6      (fp32 softmax output 4 B + bf16 probabilities 2 B) With full recomputation
(``--recompute full``) a layer keeps only its input, ``2*s*b*h/t``, and one layer's A_layer is
live while it is recomputed. Selective recomputation (``--recompute selective``, megatron
``recompute_modules``): ``mlp`` drops the 6f term (the MLP keeps only its input, already in 8h);
``core_attn`` saves nothing here, since flash attention keeps no s*s score matrix (its inputs
and output stay for the projections around it). Under the 1F1B pipeline schedule stage i keeps the activations of
``p - i`` micro-batches in flight (Narayanan et al. 2021, sec. 2.2), so stage 0 holds p of them.
The last stage also holds the logits for the log-probabilities: bf16 logits plus their fp32 copy
for the (vocab-parallel) log-softmax, ``6*s*b*V/t``. The reference forward runs without grad
and keeps nothing.

Generator GPU (one vLLM engine spans g GPUs; everything sharded by g)::

    weights          = 2 * P / g                                       (bf16)
    KV cache needed  = concurrent_seqs * max_model_len * 2 * L * max(1, k/g) * d * 2
                       (K and V, bf16; vLLM replicates KV heads when g > k)
    activations      = T * 2 * ((hq + 2*hkv)/g + 2f/g + 2h) + 4 * concurrent_seqs * V
                       (peak of one layer's QKV, fc1 output and residual for T =
                       max_num_batched_tokens tokens, plus fp32 sampler logits)

The per-token KV and activation formulas, the KV cache vLLM gets (``gpu_memory_utilization x GPU
- weights - activations - overhead``) and the start-up verdict (the KV cache must hold one
``max_model_len`` sequence) are ``megatron_rlhf.platform.engine_args`` (``engine_fit``): the same
numbers the trainer's pre-flight check refuses a recipe with. From a recipe (:func:`layouts_from_config`)
the generator layout is read from the engine arguments the run would pass to vLLM (``engine_kwargs``).

Weight-sync staging (the ``broadcast`` transport; ``megatron_rlhf.sync.staging``): the exporting
rank of each stage (TP 0, DP 0) keeps one copy of its stage's full HF tensors (gathered over TP,
unpadded vocab, bf16), S_s = 2 * (L/p * (attention + mlp + norms) + embedding on stage 0 + final
norm and, untied, the output layer on the last stage). It lives on the device when the rest of
the plan plus S_s fits in 90% of the GPU (then ``staging`` = S_s), else in pinned host memory, and
the device holds two wire buffers of ``bucket_mb`` (``staging`` = 2 x bucket). The learner's
``total`` includes it. A run decides with the same function and the same numbers: the trainer
hands :func:`learner_plan_bytes` of its config and model to the broadcast transport
(``make_transport(..., learner_plan_bytes=...)``), and each exporter calls ``plan_staging`` once,
at its first publish, with its stage's resident bytes and its GPU's total memory.

Both GPU kinds also pay ``overhead_gib`` (CUDA context, NCCL buffers, allocator fragmentation,
CUDA graphs; default 3 GiB). These are estimates: a real run adds allocator slack; leave 5-10%.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_rlhf.platform import engine_args
from megatron_rlhf.sync.staging import plan_staging

__all__ = ["GiB", "ModelShape", "PRESETS", "shape_from_hf_config", "load_shape", "LearnerLayout", "GeneratorLayout",
           "stage_params", "stage_hf_bytes", "layer_activation_bytes", "learner_memory", "generator_memory",
           "learner_staging", "learner_resident_bytes", "plan", "learner_layout_from_config", "layouts_from_config",
           "learner_plan_bytes"]

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Decoder-only transformer shape (Llama / Qwen2 / Mistral family)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False

    def padded_vocab(self, tp: int) -> int:
        """Vocab padded to a multiple of ``128 * tp`` (Megatron's make_vocab_size_divisible_by)."""
        m = 128 * tp
        return math.ceil(self.vocab_size / m) * m

    def layer_params(self) -> tuple[int, int]:
        """(TP-sharded, replicated) parameter counts of one decoder layer."""
        h, hq, hkv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sharded = h * hq + 2 * h * hkv + hq * h + 3 * h * self.ffn_size
        if self.qkv_bias:
            sharded += hq + 2 * hkv
        return sharded, 2 * h

    def total_params(self) -> int:
        """Parameters of the HF model (unpadded vocab)."""
        sh, rep = self.layer_params()
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * (sh + rep) + emb * (1 if self.tied_embeddings else 2) + self.hidden_size


PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-3.1-8B(-Instruct) config.json
    "llama3.1-8b": ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                              head_dim=128, ffn_size=14336, vocab_size=128256),
    # meta-llama/Llama-3.1-70B(-Instruct) config.json
    "llama3.1-70b": ModelShape(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                               head_dim=128, ffn_size=28672, vocab_size=128256),
    # Qwen/Qwen2.5-1.5B-Instruct config.json (QKV bias, tied): the largest model the smoke recipe names
    "qwen2.5-1.5b": ModelShape(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                               head_dim=128, ffn_size=8960, vocab_size=151936, tied_embeddings=True, qkv_bias=True),
    # Qwen/Qwen2.5-7B(-Instruct) config.json (QKV bias, untied)
    "qwen2.5-7b": ModelShape(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                             head_dim=128, ffn_size=18944, vocab_size=152064, qkv_bias=True),
}


def shape_from_hf_config(cfg: dict) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` mapping.

    Raises:
        ValueError: a required key (hidden_size, num_hidden_layers, num_attention_heads,
            intermediate_size, vocab_size) is missing.
    """
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"HF config has no '{key}': pass a decoder-only LM config.json")
    heads = cfg["num_attention_heads"]
    return ModelShape(
        hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")))


def load_shape(model: str) -> ModelShape:
    """A preset name, a ``config.json`` path or a model folder holding one.

    Raises:
        ValueError: unknown preset and no such file.
    """
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {model!r}: not a preset ({', '.join(PRESETS)}) nor a config.json / model folder")
    return shape_from_hf_config(json.loads(path.read_text()))


@dataclass(frozen=True, kw_only=True)
class LearnerLayout:
    """Learner parallel layout and batch shape (one GPU per rank)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    """Sequences per micro-batch (b)."""
    seq_len: int = 2048
    """Tokens per sequence (s): prompt + completion."""
    distributed_optimizer: bool = True
    sequence_parallel: bool = True
    """Megatron sequence parallelism (only matters when tp > 1)."""
    recompute: str = "none"
    """``none``, ``full`` or ``selective`` activation recomputation."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With ``selective``: the recomputed modules (``core_attn``, ``mlp``)."""
    reference: bool = True
    """Keep the frozen reference model on the learner GPUs."""
    attention: str = "fused"
    """``fused`` (TE, or SDPA's FlashAttention kernel: no score matrix kept) or ``unfused``
    (megatron ``DotProductAttention`` / SDPA's math kernel: ``6 * b * a/t * s^2`` bytes per layer)."""


@dataclass(frozen=True, kw_only=True)
class GeneratorLayout:
    """One vLLM engine."""

    tp: int = 1
    max_model_len: int = 2048
    concurrent_seqs: int = 256
    """Sequences the engine should hold at full length at once (vLLM ``max_num_seqs``)."""
    max_batched_tokens: int = 8192
    """vLLM ``max_num_batched_tokens`` (activation peak of a prefill chunk)."""
    gpu_memory_utilization: float = 0.9


def stage_params(shape: ModelShape, tp: int, pp: int, stage: int) -> int:
    """Parameters one GPU of pipeline stage ``stage`` holds (TP shard), padded vocab.

    Raises:
        ValueError: heads, KV heads or layers do not divide by tp / pp.
    """
    if shape.num_heads % tp or shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise ValueError(f"tp={tp} must divide the {shape.num_heads} query heads and divide or be a "
                         f"multiple of the {shape.num_kv_heads} KV heads")
    if shape.num_layers % pp:
        raise ValueError(f"pp={pp} must divide num_layers={shape.num_layers}")
    sharded, replicated = shape.layer_params()
    n = shape.num_layers // pp * (sharded / tp + replicated)
    emb = shape.padded_vocab(tp) * shape.hidden_size / tp
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += shape.hidden_size
        if not shape.tied_embeddings or pp > 1:
            n += emb
    return int(round(n))


def stage_hf_bytes(shape: ModelShape, pp: int, stage: int, dtype_bytes: int = 2) -> int:
    """Bytes of the full HF tensors of pipeline stage ``stage`` (what its exporter stages: TP
    gathered, HF vocab unpadded; the last stage's tied copy of the embedding is not exported).

    Raises:
        ValueError: ``pp`` does not divide the layers.
    """
    if shape.num_layers % pp:
        raise ValueError(f"pp={pp} must divide num_layers={shape.num_layers}")
    sharded, replicated = shape.layer_params()
    n = shape.num_layers // pp * (sharded + replicated)
    emb = shape.vocab_size * shape.hidden_size
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += shape.hidden_size + (0 if shape.tied_embeddings else emb)
    return int(n) * dtype_bytes


def layer_activation_bytes(shape: ModelShape, lay: LearnerLayout) -> float:
    """``A_layer`` of the module docstring: bytes one layer keeps for backward, one micro-batch."""
    h, f = shape.hidden_size, shape.ffn_size
    hq, hkv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    t, sb = lay.tp, lay.seq_len * lay.micro_batch
    sp = lay.sequence_parallel or t == 1
    mlp = 0 if lay.recompute == "selective" and "mlp" in lay.recompute_modules else 6 * f
    if lay.attention not in ("fused", "unfused"):
        raise ValueError(f"attention={lay.attention!r}: use fused or unfused")
    scores = 0.0
    if lay.attention == "unfused" and not (lay.recompute == "selective" and "core_attn" in lay.recompute_modules):
        scores = 6.0 * lay.micro_batch * shape.num_heads / t * lay.seq_len ** 2
    return sb * (8 * h / (t if sp else 1) + (4 * hq + 4 * hkv + mlp) / t) + scores


def learner_memory(shape: ModelShape, lay: LearnerLayout, stage: int | None = None) -> dict:
    """Per-GPU learner memory of the worst pipeline stage (or of ``stage``; the weight-sync
    staging is not included: :func:`plan` adds it).

    Returns:
        ``{"stage": i, "params": P_s, "weights": B, "grads": B, "optimizer": B, "reference": B,
        "activations": B, "logits": B, "total": B}`` in bytes (overhead not included).
    Raises:
        ValueError: bad layout (see :func:`stage_params`; ``recompute`` not none/full).
    """
    if lay.recompute not in ("none", "full", "selective"):
        raise ValueError(f"recompute={lay.recompute!r}: use none, full or selective")
    a_layer = layer_activation_bytes(shape, lay)
    t, s, b = lay.tp, lay.seq_len, lay.micro_batch
    sp = lay.sequence_parallel or t == 1
    layers = shape.num_layers // lay.pp
    best = None
    for stage in (sorted({0, lay.pp - 1}) if stage is None else [stage]):
        p = stage_params(shape, t, lay.pp, stage)
        in_flight = lay.pp - stage
        if lay.recompute == "full":
            act = in_flight * layers * 2 * s * b * shape.hidden_size / (t if sp else 1) + a_layer
        else:
            act = in_flight * layers * a_layer
        logits = 6 * s * b * shape.padded_vocab(t) / t if stage == lay.pp - 1 else 0
        parts = {
            "stage": stage, "params": p,
            "weights": 2 * p, "grads": 4 * p,
            "optimizer": 12 * p / (lay.dp if lay.distributed_optimizer else 1),
            "reference": 2 * p if lay.reference else 0,
            "activations": act, "logits": logits,
        }
        parts["total"] = sum(v for k, v in parts.items() if k not in ("stage", "params"))
        if best is None or parts["total"] > best["total"]:
            best = parts
    return best


def generator_memory(shape: ModelShape, gen: GeneratorLayout) -> dict:
    """Per-GPU memory of one vLLM engine's GPU (bytes; overhead not included).

    Returns:
        ``{"weights", "kv_cache", "kv_bytes_per_token", "activations", "total"}``.
    Raises:
        ValueError: g does not divide the query heads.
    """
    g = gen.tp
    if shape.num_heads % g:
        raise ValueError(f"gen tp={g} must divide the {shape.num_heads} query heads")
    numbers = _engine_shape(shape)
    per_token = engine_args.kv_bytes_per_token(numbers, g, 2)
    kv = gen.concurrent_seqs * gen.max_model_len * per_token
    act = engine_args.activation_bytes(numbers, g, gen.max_batched_tokens, gen.concurrent_seqs, 2)
    weights = 2 * shape.total_params() / g
    return {"weights": weights, "kv_cache": kv, "kv_bytes_per_token": per_token, "activations": act,
            "total": weights + kv + act}


def _engine_shape(shape: ModelShape) -> dict:
    """The numbers ``megatron_rlhf.platform.engine_args`` works with."""
    return {**asdict(shape), "num_params": shape.total_params()}


def _engine_fit(shape: ModelShape, gen: GeneratorLayout, gpu_mem_gib: float, overhead_gib: float):
    """``engine_args.engine_fit`` of one bf16 GPU engine of layout ``gen``."""
    kw = {"tensor_parallel_size": gen.tp, "max_model_len": gen.max_model_len, "max_num_seqs": gen.concurrent_seqs,
          "max_num_batched_tokens": gen.max_batched_tokens, "gpu_memory_utilization": gen.gpu_memory_utilization}
    return engine_args.engine_fit(kw, device="cuda", shape=_engine_shape(shape), dtype_bytes=2,
                                  device_memory_gib=gpu_mem_gib, overhead_gib=overhead_gib)


def learner_staging(shape: ModelShape, lay: LearnerLayout, stage: int, resident_bytes: float,
                    gpu_mem_gib: float, bucket_mb: float):
    """The broadcast exporter's staging of ``stage`` (:func:`megatron_rlhf.sync.staging.plan_staging`
    with the plan's resident bytes of that GPU, overhead included)."""
    return plan_staging(stage_hf_bytes(shape, lay.pp, stage), int(bucket_mb * 2**20), planned_bytes=resident_bytes,
                        device_total_bytes=gpu_mem_gib * GiB, is_cpu=False)


def learner_resident_bytes(shape: ModelShape, lay: LearnerLayout, *, overhead_gib: float = 3.0) -> dict[int, float]:
    """Resident bytes of one learner GPU of every pipeline stage (:func:`learner_memory` of that
    stage plus ``overhead_gib``; the weight-sync staging not included): what an exporter's staging
    is decided against (:func:`megatron_rlhf.sync.staging.plan_staging`'s ``planned_bytes``).

    Returns:
        ``{stage: bytes}`` for stages ``0 .. lay.pp - 1``.
    Raises:
        ValueError: bad layout (see :func:`learner_memory`).
    """
    return {s: learner_memory(shape, lay, s)["total"] + overhead_gib * GiB for s in range(lay.pp)}


def plan(shape: ModelShape, lay: LearnerLayout | None, gen: GeneratorLayout | None, *,
         gpu_mem_gib: float = 80.0, overhead_gib: float = 3.0, bucket_mb: float = 256.0) -> dict:
    """Both estimates plus their budgets and verdicts (``fits``); sizes in GiB.

    The learner row is its worst pipeline stage counting the weight-sync staging of that stage's
    exporter (``staging``: ``{place, stage_gib, device_gib, host_gib, reason}``; ``device_gib`` is
    in ``total``; ``resident`` is the total without it, what the staging is decided from).
    """
    out: dict = {"model_params": shape.total_params(), "gpu_mem_gib": gpu_mem_gib, "overhead_gib": overhead_gib}
    if lay is not None:
        rows = []
        for stage in sorted({0, lay.pp - 1}):
            m = learner_memory(shape, lay, stage)
            resident = m["total"] + overhead_gib * GiB   # = learner_resident_bytes(...)[stage]
            st = learner_staging(shape, lay, stage, resident, gpu_mem_gib, bucket_mb)
            rows.append((resident + st.device_bytes, m, st))
        _, m, st = max(rows, key=lambda r: r[0])
        row = {k: (v / GiB if k not in ("stage", "params") else v) for k, v in m.items()}
        row["total"] += overhead_gib
        row["resident"] = row["total"]
        row["staging"] = {"place": st.place, "stage_gib": st.stage_bytes / GiB, "device_gib": st.device_bytes / GiB,
                          "host_gib": st.host_bytes / GiB, "bucket_mb": bucket_mb, "reason": st.reason}
        row["total"] += st.device_bytes / GiB
        row["budget"] = gpu_mem_gib
        row["fits"] = row["total"] <= gpu_mem_gib
        out["learner"] = row
    if gen is not None:
        m = generator_memory(shape, gen)
        row = {k: (v / GiB if k != "kv_bytes_per_token" else v) for k, v in m.items()}
        row["total"] += overhead_gib
        fit = _engine_fit(shape, gen, gpu_mem_gib, overhead_gib)
        row["budget"] = fit.budget / GiB
        row["kv_capacity_seqs"] = fit.full_sequences
        row["problems"] = fit.problems()   # what would stop vLLM from starting the engine
        row["fits"] = row["total"] <= row["budget"] and not row["problems"]
        out["generator"] = row
    out["fits"] = all(out[k]["fits"] for k in ("learner", "generator") if k in out)
    return out


def learner_layout_from_config(cfg) -> LearnerLayout:
    """The :class:`LearnerLayout` a loaded :class:`megatron_rlhf.config.Config` sets:
    learner.{tensor,pipeline,data}_parallel, micro_batch_size, distributed_optimizer,
    sequence_parallel, recompute, recompute_modules, and ``generators.max_model_len`` as the
    sequence length (prompt + completion). With ``learner.max_tokens_per_microbatch`` the plan still
    counts ``micro_batch_size x max_model_len`` tokens per micro-batch; the cluster recipes set
    ``micro_batch_size`` to that budget / ``max_model_len``, so the two agree."""
    ln, gn = cfg.learner, cfg.generators
    return LearnerLayout(tp=ln.tensor_parallel, pp=ln.pipeline_parallel, dp=ln.data_parallel,
                         micro_batch=ln.micro_batch_size, seq_len=gn.max_model_len,
                         distributed_optimizer=ln.distributed_optimizer,
                         sequence_parallel=ln.sequence_parallel, recompute=ln.recompute,
                         recompute_modules=tuple(ln.recompute_modules))


def layouts_from_config(cfg, shape: ModelShape | None = None) -> tuple[ModelShape, LearnerLayout, GeneratorLayout, float]:
    """Shape and layouts from a loaded :class:`megatron_rlhf.config.Config` (a cluster recipe);
    the bucket size for :func:`plan` is ``cfg.generators.weight_sync_bucket_mb``.

    Reads model.source (HF folder; ``shape`` given: not read), the learner layout
    (:func:`learner_layout_from_config`); generators.{tensor_parallel, max_model_len, max_num_seqs,
    max_num_batched_tokens, gpu_memory_utilization}; placement.gpu_memory_gib.
    """
    gn = cfg.generators
    shape = load_shape(cfg.model.source) if shape is None else shape
    lay = learner_layout_from_config(cfg)
    kw = engine_args.engine_kwargs(gn, model=cfg.model.source, dtype=cfg.model.dtype, seed=cfg.run.seed,
                                   device="cuda")   # what each GPU engine gets
    gen = GeneratorLayout(tp=kw["tensor_parallel_size"], max_model_len=kw["max_model_len"],
                          concurrent_seqs=kw["max_num_seqs"], max_batched_tokens=kw["max_num_batched_tokens"],
                          gpu_memory_utilization=kw["gpu_memory_utilization"])
    return shape, lay, gen, cfg.placement.gpu_memory_gib


def learner_plan_bytes(cfg, shape: ModelShape, *, overhead_gib: float = 3.0) -> dict[int, float]:
    """The plan's resident bytes of one learner GPU per pipeline stage for a run's config and
    model (:func:`learner_resident_bytes` of :func:`learner_layout_from_config`): what the trainer
    hands the broadcast transport (``make_transport(..., learner_plan_bytes=...)``), so each
    stage's exporter decides once, at its first publish, whether its staging fits on its GPU
    (``tools/plan_memory.py`` prints the same decision as its ``staging`` line).

    Args:
        cfg: a loaded :class:`megatron_rlhf.config.Config`.
        shape: the model's shape (:func:`load_shape` of the run's HF folder, or a preset).
        overhead_gib: CUDA context, NCCL buffers, fragmentation (as ``plan_memory --overhead-gib``).
    Returns:
        ``{stage: bytes}`` for every pipeline stage.
    Raises:
        ValueError: the layout does not divide the model (see :func:`stage_params`).
    """
    return learner_resident_bytes(shape, learner_layout_from_config(cfg), overhead_gib=overhead_gib)
