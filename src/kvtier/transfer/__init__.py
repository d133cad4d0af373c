"""kvtier.transfer package."""
