"""Engine replicas behind one endpoint: which replica serves a request (routing)."""
