"""The quantization config and the linear + MoE methods vLLM calls per layer."""
