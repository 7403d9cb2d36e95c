"""Everything that talks to SGLang: engines, streaming rollout, reward scoring, scheduling."""
