"""The Megatron learner: model, optimiser, objectives, checkpoints and the sending end of weight sync.
It may import losses/, convert/, platform/, sync/, config, types, runtime and utils/; never generator/,
rollout/ or trainer/.

:class:`MegatronLearner` (one rank) and :class:`LearnerGroup` (TP x PP x DP
ranks as Ray actors behind the same verbs). Import them from ``megatron_rlhf.learner.actor`` /
``megatron_rlhf.learner.group`` or from here; importing this package imports neither torch nor
megatron (the classes load lazily)."""

__all__ = ["MegatronLearner", "LearnerGroup"]


def __getattr__(name):
    if name == "MegatronLearner":
        from megatron_rlhf.learner.actor import MegatronLearner

        return MegatronLearner
    if name == "LearnerGroup":
        from megatron_rlhf.learner.group import LearnerGroup

        return LearnerGroup
    raise AttributeError(name)
