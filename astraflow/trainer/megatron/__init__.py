"""The megatron trainer backend (`trainer.backend: megatron`): megatron-core's GPTModel built
from an HF directory (`spec.py`, `model.py`), HF ⇄ Megatron weights (`mapping.py`),
vocabulary-parallel logprobs (`scoring.py`), the backend (`backend.py`), and on a machine
without a GPU the redirection of Megatron's CUDA-only calls (`cpu.py`). This package's
`__init__` imports nothing, so `spec.py` stays importable without torch or megatron.
"""
