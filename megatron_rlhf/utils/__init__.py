"""Small helpers every layer may use: atomic writes (``atomic``), progress lines (``progress``), the
fault-injection hook (``faults``, off unless ``MRLHF_TEST_*`` names a point) and the stop flag.
It imports nothing of megatron_rlhf outside utils/."""
