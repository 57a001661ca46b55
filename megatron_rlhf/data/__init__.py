"""Prompt datasets (registered by name) and the seeded prompt sampler."""

from megatron_rlhf.data.prompts import (DATASETS, DatasetSpec, PromptSampler, dataset_config,
                                        load_task_prompts, register_dataset, resolve_data_path)

__all__ = ["DATASETS", "DatasetSpec", "PromptSampler", "dataset_config", "load_task_prompts",
           "register_dataset", "resolve_data_path"]
