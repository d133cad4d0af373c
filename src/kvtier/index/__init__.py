"""The page index: radix tree over token pages, per-tier residency, eviction policies (no torch)."""
