"""The dataflow rank: tasks, leases, per-policy buffers, weight registry, the single
writer of the store. Never imports torch, vllm, transformers or megatron.
"""
