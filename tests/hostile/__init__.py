"""The hostile-input corpus: tools that forge broken checkpoints, and the few real configs of non-drafters."""
