"""Integrations of questkv with model libraries."""
