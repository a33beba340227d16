"""The OpenAI-compatible HTTP server: routes, protocol models, metrics."""
