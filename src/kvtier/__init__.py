"""kvtier: a tiered KV cache for LLM inference.

The package root only names the version; import submodules for the API (``kvtier.keys``,
``kvtier.layout``, ``kvtier.config``, ...). Importing it never imports torch.
"""

__version__ = "0.1.0"
