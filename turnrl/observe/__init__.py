"""Observability: metrics sinks and progress, plots of the metrics, and the trajectory viewer (viewer/)."""
