"""How activations enter the products over blocks: opt-in settings for batched speed (`--activation-quant`):
int8 trades exactness for it, bf16x3 (AMX tiles only) keeps the exact path's numbers.

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

`--activation-quant bf16x3` rounds nothing: on AMX tiles for bfloat16 each activation goes in as three
bfloat16 whose sum it is, the codes are exact in bfloat16, and the tiles add exact products in float32
(kernels/quant_i8.c's kvlab_t16_matmul; matrices "<fmt>t16", the same bytes as "<fmt>x16"): the exact
path's numbers to float32's rounding, a row's bits its own at any batch, 1.5-2× the exact path's speed
for 16 sequences at once and slower for one (the tiles' work per group of codes is not shared).

Where the CPU has AMX tiles for bfloat16, int8's passes of 64 rows or more (a prompt's; a decode step of 64
sequences) do not round to int8: the weights are decoded and rounded to bfloat16 once a pass, the
activations too, and the tiles sum in float32 (vLLM's numbers, 2-2.5× the int8 tiles' speed there;
kernels/quant_i8.c). A row's bits again depend on nothing beside it, but they are not its int8 bits,
so `setting_name` says which the machine does, and `kvlab quality` measures the setting as served: a
window's first 512 tokens in one pass, the rest 16 at a time.

    with_activation_setting(loaded, setting)
                                    every packed matrix of the model interleaved for the setting
    activation_setting_of(model)    the setting a model's matrices were repacked for (None: exact)
    with_int8_activations(loaded)   every packed matrix of the model interleaved (a mixture's experts
                                    expert by expert: all of them then resident in memory, where the
                                    exact path leaves an unchosen expert's blocks on disk); the
                                    LoadedModel with its weight_format saying so. The file's pages
                                    the repacking read are dropped from memory after it
                                    (release_file_pages: Qwen2.5-0.5B resident after loading
                                    1.17 → 0.80 GB, at its peak 1.17 → 0.94 GB; with the scales kept
                                    as the file has them, 0.76 and 0.90 GB; `kvlab run` with its
                                    5-bit codes kept in 5 bits, at its peak 0.93 → 0.83 GB)
"""

from __future__ import annotations

import dataclasses

from kvlab.errors import KvlabError
from kvlab.model.file_pages import read_only_file_maps, release_file_pages

ACTIVATION_QUANT = ("int8", "bf16x3")  # the settings `--activation-quant` takes
# the interleaved form each setting's matrices take (kernels/quant.py): int8 codes, or the exact tiles' road
FORMS = {"int8": "x16", "bf16x3": "t16"}


def check_activation_quant(value: str | None) -> None:
    if value is not None and value not in ACTIVATION_QUANT:
        raise KvlabError(f"activation_quant {value!r} is not one of: {', '.join(ACTIVATION_QUANT)}")


def setting_name(activation_quant: str) -> str:
    """The setting as this machine computes it, as run's notes and kept quality verdicts name it: "int8
    activations", plus ", bfloat16 passes and prompt attention from 64 rows" where AMX tiles take passes
    of that many rows in bfloat16 (kernels/quant_i8.c), and a prompt pass's attention of that many queries
    (kernels/prompt_attention.c): the two compute different numbers, so each has its own measurement."""
    from kvlab.kernels import quant

    if activation_quant == "bf16x3":
        return "bf16x3 activations (exact, on bfloat16 tiles)"
    rows = quant.bf16_prompt_rows() if activation_quant == "int8" else 0
    return f"{activation_quant} activations" + (f", bfloat16 passes and prompt attention from {rows} rows" if rows else "")


def with_int8_activations(loaded):
    """with_activation_setting(loaded, "int8")."""
    return with_activation_setting(loaded, "int8")


def activation_setting_of(model) -> str | None:
    """The setting with_activation_setting repacked the model's matrices for ("int8", "bf16x3"); None
    where every matrix still multiplies float32 activations on the exact path."""
    from kvlab.model.experts import Experts
    from kvlab.quant.linear import PackedLinear

    for module in model.modules():
        if isinstance(module, PackedLinear):
            formats = module.formats
        elif isinstance(module, Experts):
            formats = [fmt for parts in module.formats.values() for fmt in parts]
        else:
            continue
        for setting, form in FORMS.items():
            if any(fmt.endswith(form) for fmt in formats):
                return setting
    return None


def with_activation_setting(loaded, setting: str):
    """The model with every PackedLinear's parts interleaved for `setting` (in place; the LoadedModel
    returned names it): "int8", 8-bit activations; "bf16x3", each activation as three bfloat16 whose sum
    it is, multiplied exactly on AMX tiles (kernels/quant_i8.c: within float32's rounding of the exact
    path, a row's numbers its own at any batch). A layer with a part of no interleaved form (float,
    MXFP4) stays on the exact path; a model with no packed matrix at all is refused in one line."""
    from kvlab.kernels import quant
    from kvlab.quant.linear import PackedLinear, PackedTensor

    check_activation_quant(setting)
    flag = f"--activation-quant {setting}"
    if loaded.model.device.type != "cpu":
        raise KvlabError(f"{flag} runs on the CPU kernels; the model is on {loaded.model.device}")
    if not quant.available():
        raise KvlabError(f"{flag} needs the C kernels, which are not built here (no compiler?)")
    if setting == "bf16x3" and not quant.exact_tiles():
        raise KvlabError(f"{flag} needs AMX tiles for bfloat16 (an Intel Xeon of the 4th generation or later); "
                         "this CPU or OS has none: the default exact products need no setting")  # fmt: skip
    form = FORMS[setting]
    from kvlab.model.experts import Experts

    from kvlab.model.huge_pages import HugeArena, into_huge_pages

    converted = kept = 0
    files = read_only_file_maps()  # the blocks as loaded leave memory as each module is repacked
    arena = HugeArena()  # the repacked matrices made in huge pages (model/huge_pages.py): no copy after
    for module in loaded.model.modules():
        if isinstance(module, Experts):
            done, left, replaced = _interleave_experts(module, form)
            converted, kept = converted + done, kept + left
            release_file_pages(replaced, files)
            continue
        if not isinstance(module, PackedLinear):
            continue
        repacked = [quant.interleave(p, form, arena.empty) for p in module.packed()]
        if any(r is None for r in repacked):
            kept += 1
            continue
        parts = [PackedTensor(fmt, p.shape, data) for (fmt, data), p in zip(repacked, module.packed())]
        replaced = [p.data for p in module.packed()]
        for i, part in enumerate(parts):
            setattr(module, f"packed_{i}", part.data)  # a registered buffer: replaced, not added
        module.formats = [p.fmt for p in parts]
        release_file_pages(replaced, files)
        converted += 1
    if not converted:
        raise KvlabError(f"{flag} applies to matrices in GGUF block formats (a .gguf file, or "
                         "--quantization q8_0 / q4_0); this model has none")  # fmt: skip
    from kvlab.model.transformer import Attention

    prompt_bf16 = setting == "int8" and quant.bf16_prompt_rows() > 0  # the prompt passes' attention too
    for module in loaded.model.modules():
        if isinstance(module, Attention):
            module.prompt_bf16 = prompt_bf16
    into_huge_pages(loaded.model)  # what was not repacked (norms, biases; load_model's own move best skipped)
    note = setting_name(setting) + (f" ({kept} matrices on the exact blocks)" if kept else "")
    return dataclasses.replace(loaded, weight_format=f"{loaded.weight_format}, {note}")


def _interleave_experts(experts, form: str) -> tuple[int, int, list]:
    """Every packed expert matrix of an Experts bank interleaved in place, expert by expert (the stacked
    buffer becomes uint8 [E, items, item bytes]); (matrices interleaved, matrices kept exact, the buffers
    replaced). A stacked matrix with a part of no interleaved form (MXFP4, float) stays exact as a whole."""
    import torch

    from kvlab.kernels import quant

    converted = kept = 0
    replaced = []
    for name in list(experts.formats):
        stacked = []
        for i in range(len(experts.formats[name])):
            per_expert = [quant.interleave(p[i], form) for p in
                          (experts.expert_parts(name, e) for e in range(experts.num_experts))]  # fmt: skip
            if any(r is None for r in per_expert):
                break
            stacked.append((per_expert[0][0], torch.stack([data for _, data in per_expert])))
        if len(stacked) != len(experts.formats[name]):
            kept += 1
            continue
        for i, (fmt, data) in enumerate(stacked):
            replaced.append(getattr(experts, f"{name}_{i}"))
            setattr(experts, f"{name}_{i}", data)  # a registered buffer: replaced, not added
            experts.formats[name][i] = fmt
        converted += 1
    return converted, kept, replaced
