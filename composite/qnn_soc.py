"""Each Snapdragon SoC's HTP architecture and the QNN precisions it runs, as the installed
ExecuTorch says (its SoC table, and the checks its QNN quantizer makes in
quantizer/annotators/htp_rules.py): the one place composite reads these facts."""

from __future__ import annotations

from collections.abc import Callable

from composite.errors import UserError


def htp_arch(soc: str) -> int:
    """`soc`'s HTP architecture (75 for v75), from ExecuTorch's SoC table."""
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset, _soc_info_table

    try:
        return int(_soc_info_table[QcomChipset[soc]].htp_info.htp_arch.value)
    except KeyError:
        raise UserError(f"ExecuTorch does not know the HTP architecture of SoC {soc}") from None


def precision_runs_on(precision: str) -> Callable[[str], bool] | None:
    """The check ExecuTorch's QNN quantizer makes of a SoC before it quantizes at `precision`
    (quantizer/annotators/htp_rules.py: LPBQ for 16a4w_block, 16-bit weights for 16a16w), as a
    predicate of the SoC's name; None where it makes none."""
    from executorch.backends.qualcomm.quantizer.annotators import htp_rules
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset, _soc_info_table

    rule = {"16a4w_block": htp_rules.validate_lpbq_support, "16a16w": htp_rules.validate_16a16w_support}.get(precision)
    return None if rule is None else lambda soc: bool(rule(_soc_info_table[QcomChipset[soc]]))
