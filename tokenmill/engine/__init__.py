"""Engine side: requests, blocks, scheduling, detokenisation. Imports no torch."""
