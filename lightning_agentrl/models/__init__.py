"""Policy models: load any HF causal LM, or build the tiny local one used by smoke runs."""


def pad_token_id(tokenizer) -> int:
    """The id that pads a batch: the tokenizer's pad token, else its end-of-sequence token (many causal
    LM tokenizers have no pad token). Id 0 is a valid pad id."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
