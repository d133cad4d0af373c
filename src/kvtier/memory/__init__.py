"""kvtier.memory package."""
