"""8-bit activations: an opt-in setting that trades exactness for batched speed (`--activation-quant int8`).

The default products (kernels/quant.c) multiply every stored weight, exactly decoded, by float32
activations: a decode step of one sequence is bound by the bytes it reads, but a step of 16 makes 16
float multiply-adds per weight and becomes bound by them. With this setting every matrix kept in a
GGUF block format is repacked at load into items of 16 rows (kernels/quant_i8.c), and every pass
quantizes its activations per sub-block of 32 values (16 for Q6_K) to int8, as llama.cpp does, so that
one integer instruction makes 64 multiply-adds. The weights stay exact; the activations are rounded to
8 bits (x̂ = dx·q, dx = max|x| / 127), which changes the logits: `kvlab quality MODEL --activation-quant
int8` measures by how much against the exact path, and run and serve repeat that verdict. A row's
result does not depend on the batch it came in, as on the exact path; but the rounding amplifies
last-bit differences upstream (a prompt prefilled packed with others, or over cached blocks, has
attention sums in another order), so greedy tokens are reproducible only where the prefill is.

    with_int8_activations(loaded)   every packed matrix of the model interleaved (a mixture's experts
                                    expert by expert: all of them then resident in memory, where the
                                    exact path leaves an unchosen expert's blocks on disk); the
                                    LoadedModel with its weight_format saying so
"""

from __future__ import annotations

import dataclasses

from kvlab.errors import KvlabError

ACTIVATION_QUANT = ("int8",)  # the settings `--activation-quant` takes


def check_activation_quant(value: str | None) -> None:
    if value is not None and value not in ACTIVATION_QUANT:
        raise KvlabError(f"activation_quant {value!r} is not one of: {', '.join(ACTIVATION_QUANT)}")


def with_int8_activations(loaded):
    """The model with every PackedLinear's parts interleaved for 8-bit activations (in place; the
    LoadedModel returned names it). A layer with a part of no interleaved form (float, MXFP4) stays on
    the exact path; a model with no packed matrix at all is refused in one line."""
    from kvlab.kernels import quant
    from kvlab.quant.linear import PackedLinear, PackedTensor

    if loaded.model.device.type != "cpu":
        raise KvlabError(f"--activation-quant int8 runs on the CPU kernels; the model is on {loaded.model.device}")
    if not quant.available():
        raise KvlabError("--activation-quant int8 needs the C kernels, which are not built here (no compiler?)")
    from kvlab.model.experts import Experts

    converted = kept = 0
    for module in loaded.model.modules():
        if isinstance(module, Experts):
            done, left = _interleave_experts(module)
            converted, kept = converted + done, kept + left
            continue
        if not isinstance(module, PackedLinear):
            continue
        repacked = [quant.interleave(p) for p in module.packed()]
        if any(r is None for r in repacked):
            kept += 1
            continue
        parts = [PackedTensor(fmt, p.shape, data) for (fmt, data), p in zip(repacked, module.packed())]
        for i, part in enumerate(parts):
            setattr(module, f"packed_{i}", part.data)  # a registered buffer: replaced, not added
        module.formats = [p.fmt for p in parts]
        converted += 1
    if not converted:
        raise KvlabError("--activation-quant int8 applies to matrices in GGUF block formats (a .gguf file, or "
                         "--quantization q8_0 / q4_0); this model has none")  # fmt: skip
    note = "int8 activations" + (f" ({kept} matrices exact)" if kept else "")
    return dataclasses.replace(loaded, weight_format=f"{loaded.weight_format}, {note}")


def _interleave_experts(experts) -> tuple[int, int]:
    """Every packed expert matrix of an Experts bank interleaved in place, expert by expert (the stacked
    buffer becomes uint8 [E, items, item bytes]); (matrices interleaved, matrices kept exact). A stacked
    matrix with a part of no interleaved form (MXFP4, float) stays exact as a whole."""
    import torch

    from kvlab.kernels import quant

    converted = kept = 0
    for name in list(experts.formats):
        stacked = []
        for i in range(len(experts.formats[name])):
            per_expert = [quant.interleave(p[i]) for p in
                          (experts.expert_parts(name, e) for e in range(experts.num_experts))]  # fmt: skip
            if any(r is None for r in per_expert):
                break
            stacked.append((per_expert[0][0], torch.stack([data for _, data in per_expert])))
        if len(stacked) != len(experts.formats[name]):
            kept += 1
            continue
        for i, (fmt, data) in enumerate(stacked):
            setattr(experts, f"{name}_{i}", data)  # a registered buffer: replaced, not added
            experts.formats[name][i] = fmt
        converted += 1
    return converted, kept
