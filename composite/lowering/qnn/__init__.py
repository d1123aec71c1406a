"""QNN HTP shards: the shard's HTP form (htp_graph.py), its quantizer (quantizer.py) with LPBQ's
block-wise 4-bit weights (lpbq.py) and their GPTQ rounding (weight_rounding.py), the shard's
lowering in named steps (shard.py), its SQNR against the float shard on held-out inputs
(held_out.py), and what is read back from its compiled contexts (pte.py)."""
