"""pagedllm: how an LLM serving engine manages KV-cache memory, in readable and in fast code.

The tiers live in sub-packages: ``pagedllm.reference`` (plain PyTorch, the specification),
``pagedllm.optimized`` and ``pagedllm.kernels`` (Triton), ``pagedllm.serving`` (CLI and server).
"""

__version__ = "0.1.0"
