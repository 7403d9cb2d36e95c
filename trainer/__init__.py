"""Training side of colocate: FSDP2 models, pure PPO math, KL control, optimizer, weight export."""
