"""`tokenmill train-draft`: an EAGLE or Medusa head trained on the target's own answers (offline,
not part of serving: the heads are read by speculative/heads.py). ``options`` (the run's settings),
``data`` (the answers and the target's features), ``train`` (the loop, its evaluation and plots)."""
