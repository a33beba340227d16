"""``tokenmill quantize``: a model's linear weights quantised to 4 or 8 bits by RTN, GPTQ or
AWQ on calibration text, layer after layer, and written as a Hugging Face folder in the
compressed-tensors ``pack-quantized`` format (what llm-compressor writes and vLLM loads).

``calibration.py`` cuts the text into samples, ``layer_inputs.py`` runs our own decoder layer
by layer over them (hooks on its linears, no engine), ``run.py`` quantises each layer's
linears from what the hooks saw and hands the result to ``quantize/compressed.py``'s writer."""
