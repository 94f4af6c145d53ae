"""lightning-agentrl: reinforcement learning for multi-turn tool-using LLM agents on PyTorch Lightning."""

__version__ = "0.1.0"
