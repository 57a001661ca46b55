"""What a rollout batch hands to the next one: surplus groups and parked partial requests.

Nothing complete is thrown away (issue 23):

* **Surplus groups.** A request that was running when a batch's quotas filled finishes with
  trainable groups beyond the quota. They go to the next batch, per task, with their weight
  version (:class:`Carry.add_surplus`): there they count toward the task's quota first (oldest
  first) and toward its staleness. Per task, so the exact per-batch task mix still holds.
* **Parked partial requests** (``generators.partial_rollouts``). When the quotas are full the
  requests still running are aborted (vLLM ``abort_request``), and each prompt's K samples are
  parked as a :class:`PartialGroup`: finished samples as they are, unfinished ones
  (``finish_reason == "abort"``) with their tokens and per-token sampling logprobs so far. The next
  batch sends them first; the engine continues each unfinished sample from prompt + its tokens
  (:func:`continue_completion` joins the two parts), so its first token keeps the old version and
  its last one gets the new: staleness and its bound use the first. This is slime's
  ``partial_rollout`` (abort, keep the partial samples, continue them first in the next rollout:
  ``slime/rollout/sglang_rollout.py``, ``abort`` and ``partial_rollout``), verl's partial
  rollout and AReaL's interruptible generation (``areal/core/workflow_executor.py``: on a weight
  update the running requests are interrupted and resubmitted with the tokens generated so far).

Carried work has its own staleness bound, ``async.max_carry_staleness`` (default
``max_staleness + 1``; :meth:`Carry.requeue_stale`). Under one-step async batch k is generated with
version k-1 and trained at version k, so what it leaves over (version k-1) would be 2 versions old
in batch k+1: one bound for fresh and carried work (as before issue 35) dropped all of it but
batch 0's, and the parked long tail first. With the separate bound it trains in batch k+1 with the
loss's importance correction: each token keeps the sampling logprob of the version that sampled
it (a continued sample's prefix that of the old version, its rest that of the new), and the
policy-gradient losses weight each token against it (``algorithm.is_correction``). What is older
still (carried twice, or parked again) is not lost: its samples are discarded and its prompt goes
back in front of the sampler (:attr:`Carry.requeued`, drawn again before new prompts:
``rollout/requeued_stale``). slime's ``--partial-rollout`` continues aborted samples whatever their
age and can mask their old prefix out of the loss (``--mask-offpolicy-in-partial-rollout``,
``slime/rollout/sglang_rollout.py``); masking drops exactly the long-tail tokens partial rollouts
exist to keep, and changes a pair's sequence logprob for Online DPO, so here the prefix trains,
corrected, under a bound. verl's fully-async mode bounds the fraction of stale samples in a
batch (``async_training.staleness_threshold``); here the bound is on age, as for fresh work.

All three are part of the checkpoint: :meth:`Carry.state_dict` encodes them in the on-disk batch
format (``rollout.batch_io.group_to_dict``), inside the producer state a checkpoint keeps, so a
resumed run trains them as the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlhf.types import Completion, Prompt, RolloutGroup

__all__ = ["ABORTED", "PartialGroup", "Carry", "continue_completion"]

ABORTED = "abort"
"""``Completion.finish_reason`` of a sample whose request was aborted before it finished (vLLM's
``FinishReason.ABORT`` prints as ``"abort"``): its tokens are a prefix to be continued."""


@dataclass(frozen=True)
class PartialGroup:
    """The K samples of one prompt whose request was aborted when a batch filled.

    Attributes:
        prompt: the prompt.
        completions: ``[K]`` samples; ``finish_reason == "abort"`` ones are unfinished prefixes
            (``token_ids [L]``, sampling ``logprobs [L]``, ``L >= 0``), the others finished.
    """

    prompt: Prompt
    completions: tuple[Completion, ...]

    @property
    def weight_version(self) -> int:
        """The oldest version of any sampled token (staleness counts from it)."""
        return min(c.weight_version for c in self.completions)

    @property
    def unfinished(self) -> int:
        """Samples still to be continued."""
        return sum(c.finish_reason == ABORTED for c in self.completions)


def continue_completion(prefix: Completion, rest: Completion) -> Completion:
    """Join an aborted sample's ``prefix`` and the engine's continuation ``rest`` (generated from
    prompt + ``prefix.token_ids``) into one completion.

    Returns:
        tokens and logprobs ``prefix + rest`` (``[L1 + L2]``, one sampling logprob per token, each
        of the version that sampled it), ``rest``'s finish reason, the texts joined, first version
        = ``prefix``'s (or ``rest``'s when the prefix is empty), last version = ``rest``'s.
    Raises:
        ValueError: ``prefix`` is not an aborted sample, or ``rest`` was sampled with an older
            version than ``prefix``'s last token.
    """
    if prefix.finish_reason != ABORTED:
        raise ValueError(f"continue_completion: the prefix finished ({prefix.finish_reason!r}); only an "
                         "aborted sample is continued")
    if not prefix.token_ids:
        return rest
    if rest.token_ids and rest.weight_version < prefix.weight_version_last:
        raise ValueError(f"continue_completion: continuation sampled with weight version {rest.weight_version}, "
                         f"older than the prefix's last token ({prefix.weight_version_last})")
    last = rest.weight_version_last if rest.token_ids else prefix.weight_version_last
    return Completion(token_ids=prefix.token_ids + rest.token_ids, logprobs=prefix.logprobs + rest.logprobs,
                      finish_reason=rest.finish_reason, text=prefix.text + rest.text,
                      weight_version=prefix.weight_version, weight_version_last=max(last, prefix.weight_version))


@dataclass
class Carry:
    """Surplus groups (per task, in arrival order), parked partial groups and requeued prompts
    between batches.

    Attributes:
        surplus: task -> trainable :class:`RolloutGroup` s beyond an earlier batch's quota.
        parked: :class:`PartialGroup` s to continue first in the next batch.
        requeued: task -> prompts of carried work too stale to train (:meth:`requeue_stale`),
            drawn again before the sampler's next prompts (:meth:`take_requeued`).
    """

    surplus: dict[str, list[RolloutGroup]] = field(default_factory=dict)
    parked: list[PartialGroup] = field(default_factory=list)
    requeued: dict[str, list[Prompt]] = field(default_factory=dict)

    def add_surplus(self, group: RolloutGroup) -> None:
        self.surplus.setdefault(group.prompt.task, []).append(group)

    def take_surplus(self, task: str, limit: int) -> list[RolloutGroup]:
        """Up to ``limit`` carried groups of ``task``, oldest first (removed from the carry)."""
        mine = self.surplus.get(task, [])
        mine.sort(key=lambda g: g.weight_version)   # stable: arrival order within a version
        out, self.surplus[task] = mine[:max(0, limit)], mine[max(0, limit):]
        return out

    def requeue_stale(self, batch_index: int, bound: int) -> dict[str, int]:
        """Take out what batch ``batch_index`` may not train and requeue its prompts.

        A surplus group or parked group is too stale when its oldest token is more than ``bound``
        versions (``async.max_carry_staleness``) older than the learner's version when it trains
        the batch (``batch_index``); its samples are discarded and its prompt appended to
        :attr:`requeued` (in carry order: surplus oldest first, then parked).

        Returns:
            task -> groups requeued (surplus and parked).
        """
        oldest = batch_index - bound
        out: dict[str, int] = {}

        def requeue(prompt: Prompt) -> None:
            self.requeued.setdefault(prompt.task, []).append(prompt)
            out[prompt.task] = out.get(prompt.task, 0) + 1

        for task, gs in self.surplus.items():
            for g in sorted((g for g in gs if g.weight_version < oldest), key=lambda g: g.weight_version):
                requeue(g.prompt)
            self.surplus[task] = [g for g in gs if g.weight_version >= oldest]
        for p in self.parked:
            if p.weight_version < oldest:
                requeue(p.prompt)
        self.parked = [p for p in self.parked if p.weight_version >= oldest]
        return out

    def take_requeued(self, task: str, limit: int) -> list[Prompt]:
        """Up to ``limit`` requeued prompts of ``task``, first requeued first (removed)."""
        mine = self.requeued.get(task, [])
        out, self.requeued[task] = mine[:max(0, limit)], mine[max(0, limit):]
        return out

    def take_parked(self) -> list[PartialGroup]:
        out, self.parked = self.parked, []
        return out

    @property
    def num_surplus(self) -> int:
        return sum(len(gs) for gs in self.surplus.values())

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-plain, in the on-disk batch format (``rollout.batch_io.group_to_dict``)."""
        from megatron_rlhf.rollout.batch_io import group_to_dict

        return {"surplus": {t: [group_to_dict(g) for g in gs] for t, gs in self.surplus.items() if gs},
                "parked": [group_to_dict(p) for p in self.parked],
                "requeued": {t: [group_to_dict(p) for p in ps] for t, ps in self.requeued.items() if ps}}

    @classmethod
    def from_state_dict(cls, state: dict | None) -> "Carry":
        """Inverse of :meth:`state_dict` (``None``: empty)."""
        from megatron_rlhf.rollout.batch_io import completion_from_dict, group_from_dict, prompt_from_dict

        if not state:
            return cls()
        surplus = {t: [group_from_dict(g) for g in gs] for t, gs in state.get("surplus", {}).items()}
        parked = [PartialGroup(prompt=prompt_from_dict(p["prompt"]),
                               completions=tuple(completion_from_dict(c) for c in p["completions"]))
                  for p in state.get("parked", [])]
        requeued = {t: [prompt_from_dict(p) for p in ps] for t, ps in state.get("requeued", {}).items()}
        return cls(surplus=surplus, parked=parked, requeued=requeued)
