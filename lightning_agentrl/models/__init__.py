"""Policy models: load any HF causal LM, or build the tiny local one used by smoke runs."""
