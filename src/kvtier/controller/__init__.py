"""kvtier.controller package."""
