"""Load generation that ships with the package: ``tokenmill bench serve`` load-tests any
OpenAI-compatible server (the repo's ``bench/`` folder holds the benchmark scripts)."""
