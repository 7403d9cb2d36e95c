"""A training run: start-up order (builder), what a run holds between steps and its
checkpoints (session), the step loop, the sleep/wake order and weight sync, where engines
run across ranks, and the start-up guards."""
