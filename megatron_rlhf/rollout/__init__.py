"""Everything between a prompt and a trained batch: the producer, carry and partial rollouts, the
overlong filter, pairs and groups, staleness and the on-disk batch format (``batch_io``). It may
import generator/ (to ask for completions), rewards/, data/, types, utils/; never learner/, trainer/."""
