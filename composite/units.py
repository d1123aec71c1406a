"""Byte units, one meaning each, for every module that counts bytes.

MB, a million bytes: files and weights as reported and budgeted (the export's summary, the
manifest's notes, composite.tune's --budget-mb, the benchmark). MIB, 2^20 bytes: memory handed out
in binary units (the HTP's context and process budgets, qnn.max_context_mb, a lowering job's
memory, the shard cache's cap)."""

MB = 1_000_000
MIB = 1 << 20
