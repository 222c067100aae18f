"""Running federated experiments from ml_collections configs."""
