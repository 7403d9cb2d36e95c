"""Where models and prompts come from: the SmolLM2 cache and tiny test models, model
aliases, the distilled sentiment reward model, prompt sources and rule rewards."""
