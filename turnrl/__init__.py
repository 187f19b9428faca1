"""turnrl: token-exact multi-turn RL post-training for LLMs with tools and simulated users."""

__version__ = "0.1.0"
