"""The runner: a step's plan turned into tensors and sampled (ModelRunner), and the one driver of the model (ModelDriver)."""
