"""One error type for everything wrong with a checkpoint, so callers can refuse it before serving."""


class Exl3FormatError(ValueError):
    """A checkpoint, tensor set or quantization_config that EXL3 kernels cannot use; the message names the tensor."""
