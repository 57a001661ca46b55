"""megatron-rlhf: asynchronous RL post-training of LLMs (megatron-core learners, vLLM generators, Ray).
Arrows point down only: trainer/ -> rollout/ -> generator/, rewards/, data/; learner/ -> losses/, convert/,
platform/; sync/ is all generator/ and learner/ share; config.py, errors.py, types.py, utils/ at the bottom."""
