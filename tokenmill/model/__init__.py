"""Model side: checkpoint loading, tokenizer, and the Llama architecture (tensors only)."""
