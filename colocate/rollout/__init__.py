"""The rollout phase above the engines: one path for every mode (rollouts), the sequential
schedule and what a step hands to training (rollout_phase), the reward of a response
(scoring, reward_fns), auto's mode picker and the held-out evaluation."""
