"""Evaluation tasks for questkv."""
