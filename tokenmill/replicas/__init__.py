"""Engine replicas behind one endpoint, on Ray Serve: routing by what each replica's KV
cache holds, and disaggregated prefill/decode (docs/ARCHITECTURE.md)."""
