"""Speculative decoding: proposers (n-gram, draft model, self) and lossless verification."""
