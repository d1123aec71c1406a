"""Quality of an export on real text: perplexity, and KL divergence and top-1 agreement against a
reference, with llama.cpp's definitions (`python -m composite.eval`; runner_cpp/eval.cpp is the C++
twin, for a phone)."""
