#!/usr/bin/env python
"""Weight-sync benchmark: learner -> vLLM worker(s) per transport, against a memcpy floor.

    .venv/bin/python bench/weight_sync.py                       # tiny random Llama, CPU transports
    .venv/bin/python bench/weight_sync.py --model smollm2       # SmolLM2-135M (517 MB fp32)
    .venv/bin/python bench/weight_sync.py --workers 2 --repeats 5 --transports object_store
    .venv/bin/python bench/weight_sync.py --layout tp2pp2 --transports broadcast   # 4 learner ranks

For each transport (``object_store``, ``filesystem``, ``broadcast``: gloo on CPU, NCCL on GPU) it
publishes the learner's weights (a real ``MegatronLearner``
actor) and pushes them to every worker (real ``VLLMGenerator`` actors) ``--repeats`` times through
the same :class:`~megatron_rlhf.generator.pool.GeneratorPool` path the trainer uses, checks the
workers' probe logprobs against the learner's after each push, and prints the median seconds of
export (learner side), load (worker side, slowest worker) and their sum. The floor is a plain
``torch`` tensor copy of the same number of bytes in the same run (``dst.copy_(src)``, median of
5): ``ratio = sync seconds / floor seconds`` says how far each transport is from moving the bytes
once through memory. GB/s = bytes x workers / sync seconds. For ``broadcast`` the same run also
measures its own floor: a raw broadcast of the same bytes over the same groups (no staging, no
overlap) plus vLLM's ``reload_weights`` from memory (``floor_bcast_s``, slowest worker), and
``sync / floor_bcast``, and times one more push with each worker's profile (waiting for the
send verdict, blocked on receives, inside ``reload_weights``, tied lm_head re-pack, prefix-cache
reset). Pushes are timed after the check's learner probe forward has finished (it is the check's
cost, not the transport's). ``blocked_s`` is what the learner's own thread spends per publish (TP
gathers, staging, export; for ``broadcast`` the broadcast itself runs in the background), set
against the median ``train_step`` seconds of the same learner on a small DPO batch.

The device-side pack (``learner.weights.measure_pack``, on the exporting learner rank of stage 0,
per ``--pack-bucket-mb``): GB/s of HF conversion + packing of the stage into bucket buffers on the
learner's device (what the broadcast exporter does per publish besides the TP gathers) against a
same-device memcpy of the same bytes; on CPU both are host memory, on a GPU this is the number
that replaces the former GPU -> host -> GPU staging. The same numbers with ``staging=host`` (pack
into a host staging buffer, then copy each chunk into one of two device wire buffers) are the
host-staged pack, ``bench/gpu_check.py``'s ``pack-host`` row on a GPU.

``broadcast-host`` (review N14): the ``broadcast`` transport forced onto the host-staged path a
stage too large for its GPU takes (``broadcast_sync.exporter_force_host_staging``: host staging,
then each chunk copied into one of two wire buffers before its broadcast, double-buffered), printed
with ``host/device`` = its sync seconds over ``broadcast``'s in the same run. On CPU what it
measures is the extra chunk copy and the double-buffered send loop; it does not measure what a GPU
adds (page-locked allocation, PCIe bandwidth of the D2H pack and H2D copies, their overlap with
NCCL on the side stream): that needs the GPU row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_floor_s(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of ``dst.copy_(src)`` for two ``nbytes`` uint8 CPU tensors (first-touch
    excluded)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def available_transports() -> list[str]:
    """Every transport (``broadcast`` runs on gloo without CUDA)."""
    return ["object_store", "filesystem", "broadcast", "broadcast-host"]


LAYOUTS = {"tp1": (1, 1, 1), "tp2pp2": (2, 2, 1), "tp2dp2": (2, 1, 2)}


def _rpc(gen, fn, *args):
    """On a ``VLLMGenerator`` actor: ``collective_rpc(fn, args)`` into its vLLM worker(s)."""
    return gen.llm.collective_rpc(fn, args=args)


def broadcast_floor(learner, is_group: bool, gens, layouts_ref, timeout: float) -> dict:
    """Raw broadcast of the staged bytes over the transport's groups, then reload from memory."""
    import ray

    from megatron_rlhf.generator import broadcast_sync as bs
    from megatron_rlhf.generator.weight_sync import on_learner_ranks

    t0 = time.perf_counter()
    send = on_learner_ranks(learner, is_group, bs.exporter_raw_send, timeout)
    got = ray.get([g.__ray_call__.remote(_rpc, bs.worker_raw_receive_then_reload, layouts_ref) for g in gens],
                  timeout=timeout)
    ray.get(send, timeout=timeout)
    per = [w for g in got for w in g]
    return {"floor_bcast_s": max(w["receive_s"] + w["reload_s"] for w in per),
            "floor_recv_s": max(w["receive_s"] for w in per), "floor_reload_s": max(w["reload_s"] for w in per),
            "floor_wall_s": time.perf_counter() - t0}


def _train_batch(vocab: int, seed: int):
    import torch

    from megatron_rlhf.types import LearnerBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 64), generator=g)
    ids[1, :16] = ids[0, :16]
    ids[3, :16] = ids[2, :16]
    mask = torch.zeros(4, 64)
    mask[:, 16:] = 1.0
    return LearnerBatch(input_ids=ids, loss_mask=mask, weight_version=0,
                        sampling_logprobs=-torch.rand(4, 64, generator=g) * mask)


def _measure_pack_on_rank(learner, bucket_mb, repeats):
    """On every learner rank: :func:`~megatron_rlhf.learner.weights.measure_pack` on stage 0's
    exporter (TP 0, DP 0), None elsewhere."""
    if learner.tp_rank or learner.dp_rank or learner.pp_rank:
        return None
    from megatron_rlhf.learner.weights import measure_pack

    return [r for staging in ("device", "host")
            for r in measure_pack(learner._model("policy"), learner.hf_config, bucket_mb=tuple(bucket_mb),
                                  repeats=repeats, staging=staging)]


def broadcast_profile(transport, gens, learner, version: int, probe, timeout: float) -> dict:
    """One more publish + push through ``BroadcastTransport.push_all``, with the time split each
    worker reports (``broadcast_sync.worker_receive``'s ``profile``): ask (waiting for the
    send verdict), wait (blocked on receives), reload (inside ``reload_weights`` outside those
    waits, incl. the tied lm_head re-pack), and the engine's prefix-cache reset."""
    import ray

    w = transport.publish(learner, version, timeout, probe)
    if w.probe_ref is not None:
        ray.get(w.probe_ref)
    t0 = time.perf_counter()
    res = transport.push_all(gens, w, timeout)
    wall = time.perf_counter() - t0
    prof = [r["profile"] for r in res]
    out = {k: max(p[k] for p in prof) for k in prof[0]}
    return {"push_wall_s": wall, "push_export_s": w.export_s, **{f"prof_{k}": v for k, v in out.items()}}


def run(model: str, workers: int, repeats: int, transports: list[str], work_dir: Path,
        layout: str = "tp1", bucket_mb: float | None = None, pack_bucket_mb=(64, 256, 1024)) -> tuple[list[dict], list[dict]]:
    import json

    import ray

    from megatron_rlhf.config import load_config
    from megatron_rlhf.generator.pool import GeneratorPool
    from megatron_rlhf.generator.vllm_engine import VLLMGenerator
    from megatron_rlhf.generator.weight_sync import is_learner_group, make_transport
    from megatron_rlhf.runtime import apply_process_env, process_env

    apply_process_env(str(work_dir / "tmp"))
    if model == "tiny":
        from megatron_rlhf.testing.tiny import make_tiny_model

        model_dir = make_tiny_model(work_dir / "tiny", "llama")
    elif model == "smollm2":
        from megatron_rlhf.convert.gguf import ensure_smollm2_hf

        model_dir = ensure_smollm2_hf(os.path.expanduser("~/.cache/megatron_rlhf"))
    else:
        model_dir = Path(model)
    tp, pp, dp = LAYOUTS[layout]
    ray.init(address="local", num_cpus=workers + tp * pp * dp, include_dashboard=False,
             runtime_env={"env_vars": process_env()},
             logging_level="WARNING")
    rows = []
    try:
        cfg = load_config(REPO / "configs" / "ci_tiny.yaml", [
            f"model.source={model_dir}", "generators.check_weight_sync=true", "generators.cpu_core=-1",
            f"generators.num_workers={workers}", "generators.max_model_len=512",
            "generators.max_new_tokens=16", f"learner.tensor_parallel={tp}", f"learner.pipeline_parallel={pp}",
            f"learner.data_parallel={dp}"] + ([f"generators.weight_sync_bucket_mb={bucket_mb}"] if bucket_mb else []))
        kw = dict(model_dir=str(model_dir), learner_cfg=cfg.learner, algorithm_cfg=cfg.algorithm, seed=0)
        if tp * pp * dp == 1:
            from megatron_rlhf.learner.actor import MegatronLearner

            learner = ray.remote(num_cpus=1)(MegatronLearner).remote(**kw)
        else:
            from megatron_rlhf.learner.group import LearnerGroup

            learner = ray.remote(num_cpus=0)(LearnerGroup).remote(rank_actor_options={"num_cpus": 1}, **kw)
        gens = [ray.remote(num_cpus=1)(VLLMGenerator).remote(model_dir=str(model_dir), generator_cfg=cfg.generators,
                                                             seed=i) for i in range(workers)]
        ray.get([a.__ray_ready__.remote() for a in (learner, *gens)])
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        train_s = []
        for i in range(2):   # the train step the publish is set against
            t0 = time.perf_counter()
            ray.get(learner.train_step.remote(_train_batch(vocab, i)))
            train_s.append(time.perf_counter() - t0)
        train_step_s = min(train_s)
        from megatron_rlhf.generator.weight_sync import on_learner_ranks

        packs = [r for r in ray.get(on_learner_ranks(learner, is_learner_group(learner, 60), _measure_pack_on_rank,
                                                      list(pack_bucket_mb), max(1, repeats))) if r][0]
        probe = list(range(10, 74))
        version = 0
        for name in sorted(transports, key=lambda n: n == "broadcast-host"):   # host-staged last: it sticks
            cfg.generators.transport = "broadcast" if name == "broadcast-host" else name
            transport = make_transport(cfg.generators, work_dir / f"run_{name}", 600)
            if hasattr(transport, "setup"):
                transport.setup(learner, gens, 600)
            if name == "broadcast-host":
                from megatron_rlhf.generator import broadcast_sync as bs

                ray.get(on_learner_ranks(learner, is_learner_group(learner, 60), bs.exporter_force_host_staging))
            pool = GeneratorPool(gens, transport=transport, generator_cfg=cfg.generators, timeout_s=600,
                                 probe=probe, log=lambda m: print(m, file=sys.stderr))
            res = []
            for _ in range(repeats):
                version += 1   # same weights, new version number: every push really loads
                w = transport.publish(learner, version, 600, probe)
                ray.get(w.probe_ref)   # the check's learner forward: not part of the transport's time
                res.append(pool.push(w))
            nbytes = res[-1]["sync/bytes"]
            floor = copy_floor_s(nbytes)
            export_s = statistics.median(r["sync/export_s"] for r in res)
            load_s = statistics.median(r["sync/load_s"] for r in res)
            total = statistics.median(r["time/sync_s"] for r in res)
            row = {"transport": name, "layout": layout, "bytes": nbytes, "workers": workers, "export_s": export_s,
                   "load_s": load_s, "sync_s": total, "floor_s": floor, "ratio": total / floor,
                   "GBps": nbytes * workers / total / 1e9, "floor_GBps": nbytes / floor / 1e9,
                   "check_max_abs_diff": max(r["sync/check_max_abs_diff"] for r in res),
                   "blocked_s": export_s, "train_step_s": train_step_s}
            if name in ("broadcast", "nccl", "broadcast-host"):
                fl = [broadcast_floor(learner, is_learner_group(learner, 60), gens, w.payload, 600)
                      for _ in range(max(1, min(repeats, 3)))]
                row["floor_bcast_s"] = statistics.median(f["floor_bcast_s"] for f in fl)
                row["floor_recv_s"] = statistics.median(f["floor_recv_s"] for f in fl)
                row["floor_reload_s"] = statistics.median(f["floor_reload_s"] for f in fl)
                row["sync_over_floor"] = total / row["floor_bcast_s"]
                version += 1
                row.update(broadcast_profile(transport, gens, learner, version, probe, 600))
            transport.close()
            rows.append(row)
    finally:
        ray.shutdown()
    return rows, packs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (random 2-layer Llama), 'smollm2', or an HF folder")
    ap.add_argument("--workers", type=int, default=1, help="vLLM workers receiving every push")
    ap.add_argument("--repeats", type=int, default=3, help="pushes per transport (median reported)")
    ap.add_argument("--transports", nargs="+", default=None, help="default: all available here")
    ap.add_argument("--layout", default="tp1", choices=sorted(LAYOUTS), help="learner TP x PP x DP")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="generators.weight_sync_bucket_mb (default: the config's)")
    ap.add_argument("--pack-bucket-mb", type=float, nargs="+", default=[64, 256, 1024],
                    help="bucket sizes (MiB) of the device-side pack measurement")
    args = ap.parse_args(argv)
    transports = args.transports or available_transports()
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mrlhf_bench_sync_") as d:
        rows, packs = run(args.model, args.workers, args.repeats, transports, Path(d), args.layout, args.bucket_mb,
                          tuple(args.pack_bucket_mb))
    print(f"\nweight sync, model={args.model}, layout={args.layout}, workers={args.workers}, "
          f"repeats={args.repeats} (median), bucket_mb={args.bucket_mb or 'config default'}")
    print(f"{'transport':<13}{'MB':>9}{'export s':>10}{'load s':>9}{'sync s':>9}{'floor s':>10}"
          f"{'ratio':>8}{'GB/s':>8}{'floor GB/s':>11}{'check':>10}")
    for r in rows:
        print(f"{r['transport']:<13}{r['bytes'] / 1e6:>9.1f}{r['export_s']:>10.3f}{r['load_s']:>9.3f}"
              f"{r['sync_s']:>9.3f}{r['floor_s']:>10.4f}{r['ratio']:>8.0f}{r['GBps']:>8.3f}"
              f"{r['floor_GBps']:>11.2f}{r['check_max_abs_diff']:>10.1e}")
    print(f"\n{'transport':<13}{'blocked s':>10}{'train step s':>13}{'blocked/step':>13}"
          f"{'bcast floor s':>14}{'(recv + reload)':>18}{'sync/floor':>11}")
    for r in rows:
        fl = (f"{r['floor_bcast_s']:>14.3f}{r['floor_recv_s']:>9.3f} + {r['floor_reload_s']:<6.3f}"
              f"{r['sync_over_floor']:>11.2f}") if "floor_bcast_s" in r else f"{'-':>14}{'':>18}{'-':>11}"
        print(f"{r['transport']:<13}{r['blocked_s']:>10.3f}{r['train_step_s']:>13.3f}"
              f"{r['blocked_s'] / r['train_step_s']:>13.1%}{fl}")
    print(f"\ndevice-side pack vs same-device memcpy (stage 0 exporter, best of {max(1, args.repeats)}; "
          f"load average {os.getloadavg()[0]:.1f})")
    print(f"{'staging':>8}{'bucket MB':>10}{'MB':>9}{'pack GB/s':>11}{'memcpy GB/s':>13}{'pack/memcpy':>13}")
    for p in packs:
        print(f"{p['staging']:>8}{p['bucket_mb']:>10g}{p['bytes'] / 1e6:>9.1f}{p['pack_GBps']:>11.2f}"
              f"{p['memcpy_GBps']:>13.2f}{p['ratio']:>13.2f}")
    by = {r["transport"]: r for r in rows}
    if "broadcast" in by and "broadcast-host" in by:
        d, h = by["broadcast"], by["broadcast-host"]
        print(f"\nhost-staged / device-staged broadcast, same run: sync {h['sync_s'] / d['sync_s']:.2f}x, "
              f"export (blocked) {h['export_s'] / d['export_s']:.2f}x, "
              f"raw floor {h['floor_bcast_s'] / d['floor_bcast_s']:.2f}x (CPU: no PCIe, no pinned memory)")
    for r in rows:
        if "push_wall_s" in r:
            prof = ", ".join(f"{k[5:]} {v:.3f}" for k, v in r.items() if k.startswith("prof_"))
            print(f"\n{r['transport']} profile of one more push (s, slowest worker): export {r['push_export_s']:.3f}, "
                  f"push_all wall {r['push_wall_s']:.3f} = {prof}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
