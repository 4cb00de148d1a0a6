"""The optimized tier: flat batches over Triton kernels, reusing the reference's logic.

Built in later issues; it imports ``pagedllm.reference`` for shared types and ``pagedllm.kernels``.
"""
