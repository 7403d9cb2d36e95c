"""Everything that talks to SGLang: engines, generation and reward requests, weight pushes, the reward feeder and its ZeroMQ channel."""
