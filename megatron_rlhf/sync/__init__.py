"""The weights' wire format, shared by the learner (which packs) and the generator (which unpacks).
``wire``: tensor metadata, bucket layout planned from names, dtypes and shapes, pack / unpack;
``staging``: where an exporter's staging buffer lives (a pure decision from the memory plan).
It may import torch, ``megatron_rlhf.platform`` and ``megatron_rlhf.utils``; never learner/ or generator/."""
