"""The rollout phase above the engines: one path for every mode and what a step hands to
training (rollouts), the schedule (schedule), a sample (sample, generation), the reward of a response
(scoring, reward_fns), auto's mode picker and the held-out evaluation."""
