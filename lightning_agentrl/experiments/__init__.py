"""Experiments: code that exists to measure something, kept out of the training path.

Each experiment is its own module and reaches a run through a hook of the core (``fit`` builds
it from its settings); with the experiment's settings at their defaults the hook is absent.
"""
