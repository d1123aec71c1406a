"""composite: split LLaMA into ExecuTorch shards across QNN HTP and XNNPACK, and run the chain."""

__version__ = "0.1.0"
