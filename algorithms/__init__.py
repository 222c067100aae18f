"""Federated learning algorithms written with the fedjx primitives."""
