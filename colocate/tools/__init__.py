"""Commands beside training: export a checkpoint, generate from a run, the doctor and its
NVIDIA driver check."""
