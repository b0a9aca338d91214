"""Shared helpers for tests and the demo: tiny model, 1P1D cluster launcher, harnesses."""
