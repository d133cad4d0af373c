"""kvtier.integrations package."""
