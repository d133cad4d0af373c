"""kvtier.engine package."""
