"""turnrl: token-exact multi-turn RL post-training for LLMs with tools and simulated users."""

__version__ = "0.1.0"

# Classes written against verl's interfaces load wherever turnrl does: compat registers its adapters with env.
from turnrl import compat  # noqa: E402,F401
