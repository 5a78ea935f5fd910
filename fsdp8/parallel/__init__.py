"""Parallel dimensions beside data parallelism (tensor, context) and parallelize, the one call that lays
a model out."""
