"""Speculative decoding proposers (n-gram, draft model, self); verification lives in worker/rejection.py."""
