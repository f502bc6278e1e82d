"""Fast kernels, each beside a PyTorch reference with the same signature."""
