"""Rollout: generation engines, the agent loop, the buffer and the background service."""
