"""Worker side: KV cache tensors, the model runner and the sampler."""
