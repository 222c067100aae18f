"""Group-structured federated datasets and cohorts."""
