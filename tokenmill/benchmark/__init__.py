"""Benchmarks that ship with the package (`tokenmill bench ...`)."""
