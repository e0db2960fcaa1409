"""Thin process entry points, one per stage (python -m workers.<stage>)."""
