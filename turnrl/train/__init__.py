"""Training: the RL loop, the policy (full or LoRA, reference), batching, updates and checkpoints."""
