"""Datasets, ordered streams with drift, and arrival traces."""
