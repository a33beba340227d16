"""`tokenmill plan`: ``command`` (bytes, capacity, the bandwidth bound, energy and cost per token;
the flags), ``step_model`` (a step's time as the machine's calibrated profile predicts it: the
probe and the prediction) and ``load_measure`` (``--measure``: the figures measured apart)."""
