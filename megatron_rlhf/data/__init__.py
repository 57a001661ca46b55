"""Prompt datasets (registered by name), the per-task loader dispatch, and the seeded samplers.
It knows no model: it may import config, types and utils/ (and a tokenizer passed in); nothing of
generator/, learner/, rollout/ or trainer/."""

from megatron_rlhf.data.mix import MultiTaskSampler, allocate_draws, estimate_yield, task_quotas
from megatron_rlhf.data.prompts import (DATASETS, DatasetSpec, PromptSampler, dataset_config,
                                        load_prompts_for_task, load_task_prompts, register_dataset,
                                        resolve_data_path, skipped_rows_text)

__all__ = ["DATASETS", "DatasetSpec", "PromptSampler", "MultiTaskSampler", "allocate_draws", "estimate_yield",
           "task_quotas", "dataset_config", "load_task_prompts", "load_prompts_for_task", "register_dataset",
           "resolve_data_path", "skipped_rows_text"]
