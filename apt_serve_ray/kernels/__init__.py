"""GPU kernels (Triton), each beside its PyTorch reference."""
