"""Weights in fewer bits: GGUF block formats kept as stored, and the linear layers that compute with them."""
