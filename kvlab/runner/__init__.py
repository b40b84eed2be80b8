"""The step plan turned into tensors, the model run, the logits sampled (ModelRunner); the KV pool's size."""
