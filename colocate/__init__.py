"""colocate: a single-node PPO/RLHF engine that time-shares SGLang generation and FSDP training."""
