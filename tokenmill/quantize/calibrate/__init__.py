"""Weight quantisation from calibration data, as a tensor-in, tensor-out toolbox: round to
nearest (``rtn``), GPTQ's error-compensating rounding (``gptq``) and AWQ's activation-aware
scales (``awq``). Nothing here knows a model; ``tokenmill/quantize`` runs the model, hands
each linear's weight and calibration inputs here, and writes what comes back."""
