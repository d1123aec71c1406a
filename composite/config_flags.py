"""The export's command line as a config: its YAML (--config), then its flags over it
(python -m composite.export; the options themselves are composite/config.py's)."""

from __future__ import annotations

import argparse

from composite.config import ROTATIONS, ExportConfig, build_config
from composite.errors import UserError
from composite.placement_options import QNN_PRECISIONS


def _int_list(text: str | None, flag: str) -> list[int] | str | None:
    if text is None or text == "auto":
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got '{text}'") from None


def config_from_flags(args) -> ExportConfig:
    """The config of `python -m composite.export`: its YAML (--config), then its flags."""
    placement = None
    if args.placement is not None:
        names = [x.strip() for x in args.placement.split(",")]
        placement = names[0] if len(names) == 1 else names
    overrides = {
        "shards": args.shards,
        "placement": placement,
        "layers_per_shard": _int_list(args.layers_per_shard, "--layers-per-shard"),
        "checkpoint": args.checkpoint,
        "params": args.params,
        "tokenizer": args.tokenizer,
        "chat_template": args.chat_template,
        "max_seq_len": args.max_seq_len,
        "prefill_len": args.prefill_len,
        "verify_len": args.verify_len,
        "output": args.output,
        "embedding_quantize": args.embedding_quantize,
        "rotate": args.rotate,
        "max_memory_gb": args.max_memory,
    }
    config = build_config(args.config, overrides)
    if args.quantize is not None:
        config.xnnpack["quantize"] = args.quantize
    if args.group_size is not None:
        config.xnnpack["group_size"] = args.group_size
    if args.attention is not None:
        config.xnnpack["attention"] = args.attention
    if args.dtype is not None:
        config.xnnpack["dtype"] = args.dtype
    if args.head_quantize is not None:
        config.xnnpack["head_quantize"] = args.head_quantize
    if args.weight_mapping is not None:
        config.xnnpack["weight_mapping"] = args.weight_mapping
    if args.qnn_precision is not None:
        config.qnn["precision"] = args.qnn_precision
    if args.no_weight_sharing:
        config.qnn["weight_sharing"] = False
    config.placements()
    return config


def parse_args(argv):
    """python -m composite.export's flags."""
    p = argparse.ArgumentParser(
        prog="python -m composite.export", description="cut a LLaMA into N shards and lower each to its own .pte"
    )
    p.add_argument("--config", help="YAML config (flags below override it)")
    p.add_argument("--shards", type=int, help="number of shards (default 1)")
    p.add_argument("--placement", help="backend per shard, comma separated (xnnpack,portable,qnn), or one for all")
    p.add_argument("--layers-per-shard", help="explicit decoder layers per shard, comma separated, e.g. 0,3,3,0")
    p.add_argument(
        "--checkpoint",
        help="Meta .pth/.pt (+ params.json), Hugging Face folder, or llama GGUF file; none = embedded default",
    )
    p.add_argument("--params", help="params.json for a Meta checkpoint")
    p.add_argument("--tokenizer", help="tokenizer.model (SentencePiece or tiktoken) or tokenizer.json")
    p.add_argument(
        "--chat-template",
        help="Jinja chat template file for --chat, instead of the tokenizer's own (tokenizer_config.json, "
        "chat_template.jinja, GGUF tokenizer.chat_template)",
    )
    p.add_argument("--max-seq-len", type=int, help="KV cache length (default 512)")
    p.add_argument("--prefill-len", type=int, help="tokens per prefill call (default 64)")
    p.add_argument(
        "--verify-len",
        type=int,
        help="tokens per call of the verify method, the runners' --lookahead and --prompt-lookup (default 8; 0: none)",
    )
    add_precision_flags(p)
    p.add_argument(
        "--max-memory",
        type=float,
        metavar="GB",
        help="what the lowering jobs may hold at once (default: 90%% of the memory available at the start)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="lower the shards on a Ray cluster (ADDRESS, else RAY_ADDRESS, else the local one): the same bytes",
    )
    p.add_argument("--output", help="artifacts folder (default ./artifacts)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON: stages, peaks, each shard's job")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="lower every shard, store none (default: ~/.cache/composite/shards, or COMPOSITE_CACHE; =off is this)",
    )
    p.add_argument("--verbose", action="store_true", help="also show the native libraries' routine log lines")
    return p.parse_args(argv)


def add_precision_flags(p) -> None:
    """The flags that say how each backend's shards hold their numbers."""
    p.add_argument(
        "--quantize",
        choices=["none", "8da4w", "8da8w"],
        help="XNNPACK linears: 8-bit dynamic activations with int4 grouped (8da4w) or int8 per-channel (8da8w) weights",
    )
    p.add_argument("--group-size", type=int, help="8da4w group size (default 32)")
    p.add_argument(
        "--head-quantize",
        choices=["8da8w", "same", "none"],
        help="a quantized shard's head: 8-bit per-channel weights (8da8w, the default), as the other linears "
        "(same), or float (none)",
    )
    p.add_argument(
        "--weight-mapping",
        choices=["symmetric_no_clipping_err", "symmetric"],
        help="how quantized weights get their scales: no weight clipped (the default), or torchao's symmetric",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "fp16"],
        help="XNNPACK shards' float dtype: weights, activations, hidden state and KV cache (default fp32)",
    )
    p.add_argument(
        "--attention",
        choices=["graph", "kernel"],
        help="XNNPACK decode attention: composite::attention over the valid slots (default), or masked matmuls",
    )
    p.add_argument(
        "--embedding-quantize",
        help="quantize the embedding table: BITS,GROUP, e.g. 8,0 (8-bit, a scale per row) or 4,32 (default none)",
    )
    p.add_argument(
        "--rotate",
        choices=["auto", *ROTATIONS],
        help="rotate the residual stream (hadamard), and each feed-forward's hidden activation (hadamard-ffn): "
        "the same model, easier to quantize; auto (default): rotated where every quantized weight is 8-bit",
    )
    p.add_argument(
        "--qnn-precision",
        choices=QNN_PRECISIONS,
        help="QNN shards' precision, where a shard's own entry does not set one (default fp16)",
    )
    p.add_argument(
        "--no-weight-sharing",
        action="store_true",
        help="QNN shards keep a copy of their weights per method: the host twin, which the x86 HTP simulator loads",
    )
