"""Helpers for the tests and CPU benchmarks only (tiny random Hugging Face models, ``testing.tiny``).
It may import anything; no product module imports it (``tests/test_import_graph.py`` checks), so the
fault-injection hook the tests drive lives in the product, ``megatron_rlhf.utils.faults``."""
