"""A QNN shard measured against the float shard: the float shard's inputs and outputs on the
held-out calibration calls, and the lowered program's SQNR on those inputs (the export prints it
and the manifest keeps it, sqnr_db)."""

from __future__ import annotations

from composite.lowering.calibration import ShardReplay, sqnr_db
from composite.runtime.encoding import convert


def held_out_pass(module, calls: list, stream: list | None, methods: dict, max_seq_len: int) -> tuple[dict, dict]:
    """(method -> the shard's inputs on its held-out call, method -> the float shard's outputs
    there). The held-out calls start a sequence of their own, so they need no other call."""
    shard = ShardReplay(module, methods, max_seq_len)
    inputs_by_method, outputs_by_method = {}, {}
    for i, call in enumerate(calls):
        if call.held_out:
            inputs = shard.inputs(call, None if stream is None else stream[i])
            outputs_by_method.setdefault(call.method, [t.clone() for t in shard.run(call, inputs)])
            inputs_by_method.setdefault(call.method, tuple(t.clone() for t in inputs))
    return inputs_by_method, outputs_by_method


def measure(
    buffer: bytes, held_out: dict[str, tuple], expected: dict[str, list], names: dict[str, tuple], io_encodings: dict
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """(method -> output name -> SQNR in dB, method -> SQNR of the main output's worst token)
    of the lowered shard (its .pte bytes) against the float shard's outputs on the held-out
    inputs, native I/O converted as the runners convert it. A trained model's residual stream
    holds single values of ~25,000 on its first token, which dominate a whole tensor's SQNR: the
    worst token shows the rest."""
    # Loaded here, not on import: the CLIs that import this module answer bad flags in a second.
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer)
    result, worst = {}, {}
    for method in [m for m in names if m in program.method_names]:  # as the manifest lists them
        inputs = held_out[method]
        encodings = io_encodings.get(method) or {}
        input_names, output_names = names[method]
        fed = [convert(t, None, encodings.get(("in", name))) for name, t in zip(input_names, inputs)]
        actual = program.load_method(method).execute(fed)
        actual = [convert(t, encodings.get(("out", name)), None) for name, t in zip(output_names, actual)]
        result[method] = {name: round(sqnr_db(e, a), 2) for name, e, a in zip(output_names, expected[method], actual)}
        main_expected, main_actual = expected[method][0][0], actual[0][0]  # [T, dim or vocab]
        worst[method] = round(min(sqnr_db(e, a) for e, a in zip(main_expected, main_actual)), 2)
    return result, worst
