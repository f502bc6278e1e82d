"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8): one reader per format, each
decoding its tensors into the one form the kernels take (weight.QuantizedWeight).

checkpoint.py ties them to config.json and to the loader; pack.py writes each format (tests and
benchmarks build checkpoints with it)."""
