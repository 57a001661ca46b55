"""Distributed-optimizer checkpoints: the sharded Adam state round-trips exactly.

Gloo ranks (``torch.multiprocessing``, OMP_NUM_THREADS=1) at DP=2 and TP=2 x DP=2 train one Online
DPO step with ``learner.distributed_optimizer=true``, save a checkpoint (megatron
``dist_checkpointing``, the optimizer's ``sharded_state_dict`` in Megatron-LM's default
``dp_reshardable`` format), train a second step (the uninterrupted run), then a freshly built
learner on the same ranks loads the checkpoint: its fp32 master weights and Adam moments must equal
the saved run's after step 1 (at TP=2 x DP=2 the checkpoint is saved asynchronously and written
while the second step trains), and after the same second step its weights and moments must equal the
uninterrupted run's (1e-6). The DP=2 checkpoint also resumes in one process at DP=1 (megatron's
format reshards over DP), with the full moments assembled from the two DP shards. The TP=2 x DP=2
ranks also check ``learner.recompute=selective``: gradients equal ``recompute=none``.

Asynchronous saves (``checkpoint.async_save``, issue 24): a checkpoint written by megatron's async
save while the next optimizer step changes the weights in place holds the weights (and Adam state)
of the step it was taken at, and the next one those of its own step (NeMo-RL #3312).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config import AlgorithmConfig, LearnerConfig, OptimizerConfig
from tests.test_learner_parallel import _batch

TOL = 1e-6
LR, EPS = 1e-2, 1e-3


def _cfg(tp=1, dp=1, **kw) -> LearnerConfig:
    kw.setdefault("distributed_optimizer", True)
    return LearnerConfig(tensor_parallel=tp, data_parallel=dp, micro_batch_size=2,
                         optimizer=OptimizerConfig(lr=LR, adam_eps=EPS, clip_grad=1.0, weight_decay=0.01), **kw)


def adam_state(learner) -> dict[str, dict[str, torch.Tensor]]:
    from megatron_rlhf.learner.checkpoint import distributed_optimizer_state

    return distributed_optimizer_state(learner.optimizer, learner.policy)


def _params(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.policy.named_parameters()}


def _worker(rank: int, world: int, tp: int, model_dir: str, init_method: str, out_dir: str) -> None:
    from megatron_rlhf.learner.actor import MegatronLearner

    torch.set_num_threads(1)
    kw = dict(model_dir=model_dir, learner_cfg=_cfg(tp, world // tp), algorithm_cfg=AlgorithmConfig(),
              total_steps=4, rank=rank, world_size=world, init_method=init_method)
    a = MegatronLearner(**kw)
    ck = os.path.join(out_dir, "ck")
    a.train_step(_batch(seed=0))
    res = {"saved": adam_state(a), "layout": a.layout()}
    a.save_checkpoint(ck, async_save=tp > 1)   # TP=2 x DP=2: written while the next step trains
    a.train_step(_batch(seed=1))
    if tp > 1:   # collective over the 4 ranks' writers
        assert a.finalize_checkpoint(blocking=True)["done"]
    res.update(run_state=adam_state(a), run_params=_params(a))
    b = MegatronLearner(**kw)     # fresh models and optimizer; the process group is shared
    a.close()
    try:
        assert b.load_checkpoint(ck) == 1
        res["loaded"] = adam_state(b)
        b.train_step(_batch(seed=1))
        res.update(resumed_state=adam_state(b), resumed_params=_params(b))
        if tp > 1:   # while b holds the process group (a re-init on the same port can fail)
            res["recompute"] = {rc: _grads_with_recompute(kw, rc) for rc in ("none", "selective")}
    finally:
        b.close()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _grads_with_recompute(kw: dict, recompute: str) -> dict:
    """HF-named gradients of one Online DPO step and the number of core-attention forward calls
    (selective recompute of core_attn runs it again in backward)."""
    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.platform.cpu import SDPACoreAttention

    cfg = kw["learner_cfg"]
    learner = MegatronLearner(**dict(kw, learner_cfg=_cfg(cfg.tensor_parallel, cfg.data_parallel,
                                                          distributed_optimizer=False, recompute=recompute,
                                                          recompute_modules=["core_attn", "mlp"])))
    calls = [0]
    for m in learner.policy.modules():
        if isinstance(m, SDPACoreAttention):
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        learner.train_step(_batch(seed=0))
        return {"grads": learner.gradients_hf(), "attention_calls": calls[0]}
    finally:
        learner.close()


def _close(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b) and a, what
    for name in a:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert a[name]["start"] == b[name]["start"]
            err = (a[name][key] - b[name][key]).abs().max().item()
            assert err <= TOL, f"{what}: {name}.{key} differs by {err}"


def _spawn(world: int, tp: int, model_dir, out) -> list[dict]:
    import torch.multiprocessing as mp

    from megatron_rlhf.learner.parallel import free_port

    mp.start_processes(_worker, args=(world, tp, str(model_dir), f"tcp://127.0.0.1:{free_port()}", str(out)),
                       nprocs=world, join=True, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_resume(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        assert res["saved"], f"rank {r} owns no optimizer state"
        _close(res["saved"], res["loaded"], f"rank {r} restored Adam state")
        _close(res["run_state"], res["resumed_state"], f"rank {r} Adam state after the next step")
        moved = max((res["run_params"][k] - res["resumed_params"][k]).abs().max().item()
                    for k in res["run_params"])
        assert moved <= TOL, f"rank {r}: next-step weights differ by {moved}"
        # the second step moved every rank's moments: the comparison is not of untouched state
        assert any((res["saved"][n]["exp_avg"] - res["run_state"][n]["exp_avg"]).abs().max() > 100 * TOL
                   for n in res["saved"])


@pytest.mark.timeout(300)
def test_dp2_checkpoint_restores_adam_moments_and_next_step_then_resumes_at_dp1(tiny_llama_dir, tmp_path):
    from megatron_rlhf.learner.actor import MegatronLearner

    ranks = _spawn(2, 1, tiny_llama_dir, tmp_path)
    _check_resume(ranks)
    # each DP rank owns a different part of the state: together they cover every element once
    owned = {n: sum(r["saved"][n]["param"].numel() for r in ranks if n in r["saved"])
             for n in set(ranks[0]["saved"]) | set(ranks[1]["saved"])}
    assert set(ranks[0]["saved"]) != set(ranks[1]["saved"]) or \
        any(ranks[0]["saved"][n]["start"] != ranks[1]["saved"][n]["start"] for n in ranks[0]["saved"])
    # DP=2 -> DP=1: one process loads the same checkpoint and takes the same second step
    one = MegatronLearner(model_dir=str(tiny_llama_dir), learner_cfg=_cfg(1, 1), algorithm_cfg=AlgorithmConfig(),
                          total_steps=4)
    try:
        assert one.load_checkpoint(str(tmp_path / "ck")) == 1
        full = adam_state(one)
        assert {n: full[n]["param"].numel() for n in full} == owned
        for r in ranks:   # the DP=1 state restricted to each DP=2 shard's range is that shard
            for n, sh in r["saved"].items():
                lo, hi = sh["start"], sh["start"] + sh["param"].numel()
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert (full[n][key][lo:hi] - sh[key]).abs().max().item() <= TOL, (n, key)
        one.train_step(_batch(seed=1))
        params = _params(one)
        err = max((params[k] - ranks[0]["run_params"][k]).abs().max().item() for k in params)
        assert err <= TOL, f"DP=1 resume: next-step weights differ from the DP=2 run by {err}"
    finally:
        one.close()


@pytest.mark.timeout(300)
def test_tp2_dp2_checkpoint_resumes_exactly_and_selective_recompute_keeps_gradients(tiny_llama_dir, tmp_path):
    ranks = _spawn(4, 2, tiny_llama_dir, tmp_path)
    assert sorted((r["layout"]["tp_rank"], r["layout"]["dp_rank"]) for r in ranks) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_resume(ranks)
    # learner.recompute=selective (core_attn + mlp) at TP=2: same gradients as recompute=none, and
    # the attention really ran again in backward
    reporting = [r for r in ranks if r["recompute"]["none"]["grads"]]   # gradients_hf: DP rank 0
    assert reporting
    for r in reporting:
        none, sel = r["recompute"]["none"], r["recompute"]["selective"]
        assert set(none["grads"]) == set(sel["grads"])
        err = max((none["grads"][k] - sel["grads"][k]).abs().max().item() for k in none["grads"])
        assert err <= TOL, f"selective recompute changed the gradients by {err}"
        assert sel["attention_calls"] == 2 * none["attention_calls"] > 0


@pytest.mark.timeout(120)
def test_a_save_before_the_first_step_leaves_training_unchanged(tiny_llama_dir, tmp_path):
    """Saving a never-stepped distributed optimizer primes its state: that must equal a fresh Adam."""
    from megatron_rlhf.learner.actor import MegatronLearner

    kw = dict(model_dir=str(tiny_llama_dir), learner_cfg=_cfg(), algorithm_cfg=AlgorithmConfig(), total_steps=4)
    a, b = MegatronLearner(**kw), MegatronLearner(**kw)
    try:
        a.save_checkpoint(str(tmp_path / "ck0"))
        for learner in (a, b):
            learner.train_step(_batch(seed=0))
        pa, pb = _params(a), _params(b)
        assert max((pa[k] - pb[k]).abs().max().item() for k in pa) == 0.0
        assert b.load_checkpoint(str(tmp_path / "ck0")) == 0   # and it loads (step 0, zero moments)
        assert all(s["exp_avg"].abs().max() == 0 for s in adam_state(b).values())
    finally:
        b.close()
        a.close()


@pytest.mark.timeout(30)
def test_resume_rules_allow_a_dp_change_only_with_the_distributed_optimizer_and_map_state_files():
    from types import SimpleNamespace as NS

    from megatron_rlhf.learner.checkpoint import OPTIMIZER_FORMAT, _check_layout, _source_rank

    def learner(tp, pp, dp, dist, coords=(0, 0, 0), rank=0):
        return NS(groups=NS(tp=tp, pp=pp, dp=dp, rank=rank), use_distributed_optimizer=dist,
                  hf_config=NS(model_type="llama"), tp_rank=coords[0], pp_rank=coords[1], dp_rank=coords[2])

    saved = {"tp": 2, "pp": 2, "dp": 2, "model_type": "llama", "optimizer_format": OPTIMIZER_FORMAT}
    _check_layout(learner(2, 2, 1, True), saved, "ck")            # DP 2 -> 1
    _check_layout(learner(2, 2, 4, True), saved, "ck")            # DP 2 -> 4
    with pytest.raises(ValueError, match="tensor_parallel"):
        _check_layout(learner(1, 2, 4, True), saved, "ck")
    with pytest.raises(ValueError, match="distributed_optimizer=True"):
        _check_layout(learner(2, 2, 2, False), saved, "ck")
    with pytest.raises(ValueError, match="needs learner.distributed_optimizer=true"):
        _check_layout(learner(2, 2, 1, False), dict(saved, optimizer_format="torch"), "ck")
    # megatron's rank order tp-dp-pp: (tp 1, pp 1, dp 0) of TP2 x DP1 x PP2 restores the state file
    # of (tp 1, pp 1, dp 0) of the saved TP2 x DP2 x PP2 layout = rank 1 + 2 * (0 + 2 * 1) = 5;
    # after DP 2 -> 4, DP ranks 2 and 3 take DP rank 1's file
    assert _source_rank(learner(2, 2, 1, True, (1, 1, 0), rank=3), saved) == 5
    assert _source_rank(learner(2, 2, 4, True, (0, 0, 3), rank=6), saved) == 2
    assert _source_rank(learner(2, 2, 2, True, (0, 1, 1), rank=6), saved) == 6


@pytest.mark.timeout(180)
@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["dist_opt", "torch_opt"])
def test_async_checkpoints_hold_their_steps_weights_while_the_next_step_trains(
        tiny_llama_dir, tmp_path, monkeypatch, distributed_optimizer):
    """Step 1, async save (a writer slowed by 3 s, utils.faults), step 2 at once (in-place update
    of the parameters and moments the writer reads on CPU), async save, step 3. Checkpoint 1 must
    load as step 1's weights and optimizer state, checkpoint 2 as step 2's, the two must differ,
    and the writer of checkpoint 1 must still have been running when step 2 had finished."""
    import time

    from megatron_rlhf.learner.actor import MegatronLearner
    from megatron_rlhf.utils.faults import SLOW_WRITER_ENV

    monkeypatch.setenv(SLOW_WRITER_ENV, "3")
    kw = dict(model_dir=str(tiny_llama_dir), learner_cfg=_cfg(distributed_optimizer=distributed_optimizer),
              algorithm_cfg=AlgorithmConfig(), total_steps=4)
    a = MegatronLearner(**kw)
    try:
        saved = []
        for step in (1, 2):
            a.train_step(_batch(seed=step))
            saved.append({"params": _params(a), "state": adam_state(a) if distributed_optimizer
                          else _tensors(a.optimizer.state_dict())})
            t0 = time.time()
            a.save_checkpoint(str(tmp_path / f"ck{step}"), async_save=True)
            blocked = time.time() - t0
            assert not (tmp_path / f"ck{step}" / "policy" / "metadata.json").exists()   # not complete yet
            a.train_step(_batch(seed=10 + step))   # the next step trains on while it is written
            t_trained = time.time()
            assert a.finalize_checkpoint(blocking=False)["done"] is False
            info = a.finalize_checkpoint(blocking=True)
            # the writer was still writing when the next step had trained (it may start after that
            # step on a loaded machine: the weights check below then proves it read a snapshot)
            assert info["done"] and info["write_end"] > t_trained, (info, t_trained)
            assert info["write_s"] >= 3.0 > blocked, (info, blocked)
            assert (tmp_path / f"ck{step}" / "policy" / "metadata.json").is_file()
        assert a.finalize_checkpoint() is None
    finally:
        a.close()
    assert max((saved[0]["params"][k] - saved[1]["params"][k]).abs().max().item() for k in saved[0]["params"]) > 1e-4
    b = MegatronLearner(**kw)
    try:
        for step, want in zip((1, 2), saved):
            assert b.load_checkpoint(str(tmp_path / f"ck{step}")) == 2 * step - 1
            got = _params(b)
            err = max((got[k] - want["params"][k]).abs().max().item() for k in got)
            assert err == 0.0, f"checkpoint {step}: weights differ from step {step}'s by {err}"
            if distributed_optimizer:
                _close(want["state"], adam_state(b), f"checkpoint {step} Adam state")
            else:
                got_state = _tensors(b.optimizer.state_dict())
                assert len(got_state) == len(want["state"]) > 0
                assert all(torch.equal(x, y) for x, y in zip(got_state, want["state"])), f"checkpoint {step}"
    finally:
        b.close()


def _tensors(obj) -> list[torch.Tensor]:
    """Copies of every tensor in a (nested) state dict, in a fixed order."""
    if torch.is_tensor(obj):
        return [obj.detach().clone()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _failing_writer():
    raise OSError("disk gone")


@pytest.mark.timeout(60)
def test_async_writer_finalizes_after_the_write_and_names_a_writer_that_failed(groups, tmp_path):
    """AsyncCheckpointWriter on megatron's AsyncCallsQueue: a request's finalize functions run
    after its forked writer finished (the file is there), and a writer that raised is an error at
    finalize (not a checkpoint completed without its files)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from megatron_rlhf.learner.checkpoint import AsyncCheckpointWriter

    writer, out, seen = AsyncCheckpointWriter(), tmp_path / "state.pt", []
    writer.schedule(str(tmp_path), [AsyncRequest(torch.save, ({"w": torch.ones(3)}, out),
                                                 [lambda: seen.append(out.is_file())])])
    assert writer.pending == str(tmp_path)
    info = writer.finalize(blocking=True)
    assert info["done"] and seen == [True] and info["write_end"] >= info["write_start"] > 0
    assert torch.equal(torch.load(out)["w"], torch.ones(3)) and writer.finalize() is None
    writer.schedule(str(tmp_path / "bad"), [AsyncRequest(_failing_writer, (), [])])
    with pytest.raises(RuntimeError, match=r"writer of .*bad exited before it finished"):
        writer.finalize(blocking=True)
    assert writer.pending is None


def _slow(fn, delay_s, *args, **kwargs):
    import time

    time.sleep(delay_s)
    return fn(*args, **kwargs)


@pytest.mark.timeout(90)
def test_async_checkpoint_folders_get_their_own_metadata_when_the_first_writer_is_slowest(groups, tmp_path):
    """Two dist_checkpointing folders in one asynchronous checkpoint, the first one's writer slowed
    by 2 s: each folder must load as its own tensors. megatron's writers of one process share one
    results queue, so writers running side by side finish out of order and the first folder's
    finalize would take the second's write results (session 7: ``KeyError: MetadataIndex`` on
    load); AsyncCheckpointWriter writes a checkpoint's requests in order in one process."""
    from functools import partial

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_rlhf.learner.checkpoint import AsyncCheckpointWriter

    want = {"policy": {"w": torch.arange(12.0).reshape(3, 4)},
            "reference": {"v": -torch.arange(6.0), "u": torch.full((5, 2), 7.0)}}

    def sharded(tensors):
        return {k: ShardedTensor.from_rank_offsets(k, t.clone()) for k, t in tensors.items()}

    requests = []
    for name, tensors in want.items():
        (tmp_path / name).mkdir()
        requests.append(dist_checkpointing.save(sharded(tensors), str(tmp_path / name), async_sharded_save=True))
    requests[0] = requests[0]._replace(async_fn=partial(_slow, requests[0].async_fn, 2.0))
    writer = AsyncCheckpointWriter()
    writer.schedule(str(tmp_path), requests)
    assert writer.finalize(blocking=True)["done"]
    for name, tensors in want.items():
        empty = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in tensors.items()}
        got = dist_checkpointing.load(empty, str(tmp_path / name))
        assert set(got) == set(tensors) and all(torch.equal(got[k], t) for k, t in tensors.items()), name


def _orphaned_writer(pid_file: str) -> None:
    """Intermediate process: fork a writer that records its pid and writes for 60 s, then exit."""
    from megatron_rlhf.learner.checkpoint import _write_in_order

    parent = os.getpid()
    if os.fork() == 0:   # the writer, as TemporalAsyncCaller forks it
        try:
            import time

            def write():   # forks a write worker first, as megatron's write_preloaded_data_multiproc
                worker = os.fork()
                if worker == 0:
                    time.sleep(60)
                    os._exit(0)
                open(pid_file, "w").write(f"{os.getpid()} {worker}")
                time.sleep(60)

            _write_in_order([(write, (), {})], [0.0, 0.0], 0.0, parent_pid=parent)
        finally:
            os._exit(0)
    os._exit(0)   # the learner dies (kill -9 of the run) while its writer writes; the test kills the writer (Ray does)


@pytest.mark.timeout(60)
def test_a_forked_checkpoint_writer_ends_when_its_learner_is_gone(tmp_path):
    """Session 8: after kill -9 during an async save a forked writer hung for ever (400 MB, blocked
    on a futex). The writer watches the learner that forked it and, within about a second, ends
    with its own write workers (its process group)."""
    import multiprocessing as mp
    import time

    pid_file = tmp_path / "writer.pid"
    p = mp.get_context("fork").Process(target=_orphaned_writer, args=(str(pid_file),))
    p.start()
    p.join(10)
    deadline = time.time() + 10
    while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    pids = [int(x) for x in pid_file.read_text().split()]
    os.kill(pids[0], 9)   # Ray kills the dead learner's direct children: the writer, not its workers

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    t0 = time.time()
    while any(alive(p) for p in pids) and time.time() - t0 < 10:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), f"writer, worker {pids}: one still runs after its learner exited"
