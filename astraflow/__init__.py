"""AstraFlow: dataflow-oriented reinforcement learning for agentic LLMs on HPC schedulers."""
__version__ = "0.1.0"
