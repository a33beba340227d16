"""Weight and KV-cache quantisation."""
