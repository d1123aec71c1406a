"""What composite.tune writes and says: the tuned export config, the frontier's plot, its header
and the summary __main__ prints."""

from __future__ import annotations

from pathlib import Path

import yaml

from composite.config import build_config
from composite.tune.candidates import EMBEDDING_PLACEMENT, choice_name
from composite.tune.search import Recipe
from composite.units import MB


def describe(recipe: Recipe) -> str:
    parts = []
    for option in recipe.options:
        parts.append(f"emb {option.choice}" if isinstance(option.choice, str) else option.choice.name)
    return " | ".join(parts)


def tuned_config(args, groups, recipe: Recipe, rotation: str) -> dict:
    choices = recipe.choices()
    config = {}
    if args.checkpoint:
        config["checkpoint"] = args.checkpoint
    if args.params:
        config["params"] = args.params
    config["shards"] = len(groups)
    config["layers_per_shard"] = [g.layer_end - g.layer_start for g in groups]
    placement = []
    for group in groups:
        if group.kind == "embedding":
            placement.append(dict(EMBEDDING_PLACEMENT))
        else:
            placement.append(choices[group.index].placement(head=group.kind == "head"))
    config["placement"] = placement
    if choices[groups[0].index] != "none":
        config["embedding_quantize"] = choices[groups[0].index]
    config["max_seq_len"] = args.max_seq_len
    config["prefill_len"] = args.prefill_len
    config["xnnpack"] = {"group_size": args.group_size}
    config["qnn"] = {"soc": args.soc, "block_size": args.qnn_block_size}
    config["rotate"] = rotation  # what was measured, whatever the export's auto would pick
    config["output"] = args.artifacts or f"artifacts/{Path(args.output).stem}"
    return config


def write_config(path: Path, config: dict, header: list[str]) -> None:
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header) + body)
    build_config(str(path), {})  # the export reads it: refuse to leave one it would not


def plot(path: Path, recipes: list[Recipe], uniform: dict[str, Recipe], chosen: Recipe, budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ax.step([r.bytes / MB for r in recipes], [r.kld for r in recipes], where="post", label="tuned (Pareto frontier)")
    for i, (label, recipe) in enumerate(sorted(uniform.items(), key=lambda item: item[1].bytes)):
        ax.scatter(recipe.bytes / MB, recipe.kld, marker="s", s=18, color="gray")
        # Neighbours alternate above and below their point: uniform recipes of close sizes stay legible.
        offset = (3, 3) if i % 2 == 0 else (3, -9)
        ax.annotate(label, (recipe.bytes / MB, recipe.kld), fontsize=6, xytext=offset, textcoords="offset points")
    ax.scatter(chosen.bytes / MB, chosen.kld, marker="*", s=160, color="red", zorder=3, label="chosen")
    ax.axvline(budget, linestyle="--", color="red", linewidth=0.8, label=f"budget {budget:g} MB")
    ax.set_yscale("symlog", linthresh=1e-4)  # a log scale that still shows the float recipe's 0
    ax.set_ylim(bottom=0)
    ax.set_xlabel("weights, MB")
    ax.set_ylabel("predicted mean KLD against the float model")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def kld_text(value: float) -> str:
    return f"{value:.3g}"


def header(args, best) -> list[str]:
    chosen, whole = best.chosen, best.whole
    return [
        f"composite.tune: lowest predicted KLD within {args.budget_mb:g} MB over {args.candidates}",
        f"checkpoint {args.checkpoint or '(embedded default)'}, text {args.text}, "
        f"{best.sens.scored_tokens} tokens scored, rotation {best.rotation}",
        f"weights {chosen.bytes / MB:.2f} MB; predicted KLD {kld_text(chosen.kld)} (sum of groups), "
        f"measured as a whole in PyTorch {kld_text(whole['kld'])}, top-1 {100 * whole['top1']:.1f}%",
    ]


def summary(best, searches: list, verified: dict | None, output: Path, plot_path: Path) -> dict:
    chosen, measured = best.chosen, best.measured
    return {
        "rotation": best.rotation,
        "rotations": {
            s.rotation: {"recipe": describe(s.chosen), "mb": round(s.chosen.bytes / MB, 3), "kld_whole": s.whole["kld"]}
            for s in searches
        },
        "groups": [
            {
                "group": g.name,
                "shard": g.index,
                "choices": {
                    choice_name(o.choice): {
                        "mb": round(o.bytes / MB, 3),
                        "kld": o.kld,
                        "top1": measured[(g.index, choice_name(o.choice))]["top1"],
                        "cached": measured[(g.index, choice_name(o.choice))]["cached"],
                    }
                    for o in options
                },
            }
            for g, options in zip(best.sens.groups, best.per_group)
        ],
        "frontier": [{"mb": round(r.bytes / MB, 3), "kld": r.kld, "recipe": describe(r)} for r in best.recipes],
        "uniform": {
            label: {
                "mb": round(r.bytes / MB, 3),
                "decode_mb": round(r.decode_bytes / MB, 3),
                "kld_predicted": r.kld,
                **(
                    {"kld_whole": best.uniform_whole[label]["kld"], "top1_whole": best.uniform_whole[label]["top1"]}
                    if label in best.uniform_whole
                    else {}
                ),
            }
            for label, r in best.uniform.items()
        },
        "chosen": {
            "recipe": describe(chosen),
            "mb": round(chosen.bytes / MB, 3),
            "decode_mb": round(chosen.decode_bytes / MB, 3),
            "kld_predicted": chosen.kld,
            "kld_whole": best.whole["kld"],
            "top1_whole": best.whole["top1"],
        },
        "verified": verified,
        "scored_tokens": best.sens.scored_tokens,
        "config": str(output),
        "plot": str(plot_path),
    }
