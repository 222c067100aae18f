"""Flax models and their per-example losses and metrics."""
