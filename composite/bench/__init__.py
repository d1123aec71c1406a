"""`python -m composite.bench`: the performance benchmark against ExecuTorch's own llama."""
