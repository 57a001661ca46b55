"""The Megatron learner: :class:`MegatronLearner` (import it from ``megatron_rlhf.learner.actor``
or from here; importing this package imports torch and megatron lazily via the actor module)."""

__all__ = ["MegatronLearner"]


def __getattr__(name):
    if name == "MegatronLearner":
        from megatron_rlhf.learner.actor import MegatronLearner

        return MegatronLearner
    raise AttributeError(name)
