"""Rewards: answer extraction, reward functions, and their dispatch on trajectories."""
