"""Model execution: the engine→runner contract (`ForwardBatch`), the `ModelRunner`, the sampler."""
