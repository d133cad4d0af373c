"""kvtier.serve package."""
