"""The controller: the loop, the run verbs, setup (Ray, actors, reward models, prompts), checkpoints,
eval, metrics, report and the run folder. It may import every package below it (rollout/, generator/,
learner/, rewards/, data/, convert/, platform/, sync/, utils/); nothing in megatron_rlhf imports it."""
