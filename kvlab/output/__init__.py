"""Turning generated token ids into the text a user sees: incremental detokenization and stop strings."""
