"""Small helpers shared by the trainer's writers (:mod:`megatron_rlhf.utils.atomic`)."""
