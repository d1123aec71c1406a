"""The export's command line as a config: its YAML (--config), then its flags over it
(python -m composite.export; the options themselves are composite/config.py's)."""

from __future__ import annotations

from composite.config import ExportConfig, build_config
from composite.errors import UserError


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
