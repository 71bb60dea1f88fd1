"""Compute over EXL3 experts and linears. Everything here takes plain tensors; nothing imports vLLM."""
