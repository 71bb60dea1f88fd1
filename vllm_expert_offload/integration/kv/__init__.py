"""KV-cache block sizes: per-group resolution each attention backend can use."""
