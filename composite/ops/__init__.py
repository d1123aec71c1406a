"""Operators of our own that ExecuTorch runs with kernels of our own (runner_cpp/kernels/)."""
