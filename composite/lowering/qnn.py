"""Qualcomm QNN HTP lowering.

This build of composite does not lower to QNN yet: a qnn placement stops the export before any
work with one line that says so. Keeping the check here means the placement schema, the config
validation and the manifest already carry qnn shards end to end.
"""

from __future__ import annotations

from composite.errors import UserError


def require_support() -> None:
    raise UserError(
        "qnn placement is not available: this version of composite lowers only xnnpack and portable "
        "shards; place this shard on xnnpack or portable"
    )


def lower(module, example_inputs: dict, options: dict):
    require_support()
