"""KV-cache block sizes, free of vLLM: the rules that pick a block size per group, and the kernel truth table."""
