"""Worker process of tests/test_convert_tools.py (not a test module): loads converted checkpoints
into megatron GPTModels under TP=2 and PP=2 (2 processes, gloo) and compares their logits with
transformers' (reference logits computed by the parent test).

    python tests/convert_parallel_worker.py --rank R --world 2 --port P --job job.json --out out_R.json

``job.json``: ``{"cases": [{"name", "hf", "ckpt", "tp", "pp", "ids", "ref"}]}`` where ``ids`` is a
``[B, S]`` token list and ``ref`` a ``torch.save``'d ``[B, S, V]`` float32 tensor. Each rank writes
``{name: max |megatron - transformers| logit}`` for the cases whose full logits it holds
(TP: rank 0 after gathering the vocab shards; PP: the last stage).
"""

from __future__ import annotations

import argparse
import json


def _forward(model, ids, tp: int, pp: int, ps):
    """Full-vocab logits ``[B, S, Vpad]`` on the rank that holds them, else None."""
    import torch
    import torch.distributed as dist

    pos = torch.arange(ids.shape[1]).expand_as(ids)
    if pp > 1:
        if ps.is_pipeline_first_stage():
            hidden = model(input_ids=ids, position_ids=pos, attention_mask=None)  # [S, B, h]
            dist.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        buf = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
        dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(buf)
        return model(input_ids=ids, position_ids=pos, attention_mask=None)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None).contiguous()  # [B,S,V/tp]
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1) if ps.get_tensor_model_parallel_rank() == 0 else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlhf.convert import transformer_config_from_hf
    from megatron_rlhf.convert.dist_ckpt import load_model_from_checkpoint, read_layout
    from megatron_rlhf.learner.model import build_gpt_model, load_hf_config
    from megatron_rlhf.platform import get_platform

    torch.set_num_threads(1)
    platform = get_platform()
    platform.install(function_mode=True)  # PP: tied-embedding all-reduce allocates on "cuda"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.world)
    cases = json.load(open(a.job))["cases"]
    results = {}
    for tp, pp in sorted({(c["tp"], c["pp"]) for c in cases}):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        platform.seed(0)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        for c in (c for c in cases if (c["tp"], c["pp"]) == (tp, pp)):
            cfg = load_hf_config(c["hf"])
            tcfg = transformer_config_from_hf(cfg, tp=tp, pp=pp, perform_initialization=True)
            model = build_gpt_model(cfg, tcfg, platform=platform, pg_collection=pg,
                                    pre_process=ps.is_pipeline_first_stage(),
                                    post_process=ps.is_pipeline_last_stage(),
                                    vocab_size=read_layout(c["ckpt"])["padded_vocab_size"])
            load_model_from_checkpoint(model, c["ckpt"])
            with torch.no_grad():
                logits = _forward(model.eval(), torch.tensor(c["ids"]), tp, pp, ps)
            if logits is not None:
                ref = torch.load(c["ref"])
                results[c["name"]] = (logits[..., : ref.shape[-1]] - ref).abs().max().item()
        dist.barrier()
        ps.destroy_model_parallel()
    json.dump(results, open(a.out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":  # guard: dist_checkpointing's spawn Manager re-imports __main__
    main()
