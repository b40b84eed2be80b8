"""A rope-scaling override (`--rope-scaling JSON`, `LLM(rope_scaling=...)`) on a tiny random llama trained
to 512 positions: the rotary tables and the logits are transformers' for the same config, the context
limit is stretched only by the override, and bad input is one line with exit code 2."""

from __future__ import annotations

import pytest
import torch

from kvlab.cli import main
from kvlab.config.rope import parse_rope_scaling
from kvlab.errors import KvlabError

TRAINED = 512  # tiny.build_tiny's max_position_embeddings
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": TRAINED}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("tiny-llama-rope"))


def hf_config(directory, scaling: dict):
    import transformers

    config = transformers.LlamaConfig.from_pretrained(directory)
    config.rope_parameters = {**scaling, "rope_theta": 10000.0}
    return config


@pytest.mark.parametrize("scaling", [
    YARN,
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.25, "original_max_position_embeddings": 256},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])  # fmt: skip
def test_override_builds_transformers_rotary_tables(tiny_llama, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvlab.llm import with_rope_scaling
    from kvlab.model.loader import load_model

    loaded = with_rope_scaling(load_model(tiny_llama), scaling, 2 * TRAINED)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config(tiny_llama, scaling), "cpu")
    angles = torch.outer(torch.arange(2 * TRAINED, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # [P, D]
    half = angles.shape[1] // 2
    rotary = loaded.model.rotary
    assert rotary.cos.shape == (2 * TRAINED, 16)
    torch.testing.assert_close(rotary.cos, angles.cos() * attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.sin[:, half:], (angles.sin() * attention_factor)[:, half:], rtol=0, atol=1e-6)
    if scaling["rope_type"] == "yarn":
        assert attention_factor > 1  # the override really scales: not the plain table
        assert not torch.allclose(rotary.cos, load_model(tiny_llama, max_positions=2 * TRAINED).model.rotary.cos)


def test_override_logits_match_transformers_past_the_trained_context(tiny_llama):
    import transformers

    from kvlab.kv.cache import ContiguousKVCache
    from kvlab.llm import with_rope_scaling
    from kvlab.model.loader import load_model
    from kvlab.runner.driver import ModelDriver

    ids = torch.randint(0, 512, (1, 700), generator=torch.Generator().manual_seed(3))  # 188 past the trained 512
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, config=hf_config(tiny_llama, YARN)).eval()
    with torch.no_grad():
        expected = hf(ids).logits[0]  # [700, V]
    loaded = with_rope_scaling(load_model(tiny_llama), YARN)
    cache = ContiguousKVCache.for_model(loaded.config, 700)
    driver = ModelDriver(loaded.model)
    chunks = [ids[:, c : c + 128] for c in range(0, 700, 128)]  # a chunked prefill: the last chunk is short
    got = torch.cat([driver.run(x, cache, logits_index=torch.arange(x.shape[1]))[0] for x in chunks])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    plain = transformers.LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        moved = (plain(ids).logits[0, TRAINED:] - expected[TRAINED:]).abs().max()
    assert moved > 1e-3  # 10× the tolerance: YaRN changed them (a random model barely uses positions)


def test_llm_context_is_stretched_only_by_the_override(tiny_llama):
    from kvlab import LLM, SamplingParams

    with pytest.raises(KvlabError, match="--rope-scaling"):
        LLM(tiny_llama, max_model_len=1024)
    llm = LLM(tiny_llama, max_model_len=1024, rope_scaling='{"rope_type": "yarn", "factor": 2.0}')
    assert llm.config.max_position_embeddings == TRAINED  # the model's own limit is kept, and said
    assert llm.config.context_limit == 1024 and llm.config.rope.type == "yarn"
    assert any("rope scaling overridden: yarn, factor 2" in note for note in llm.config.notes)
    prompt = {"prompt_token_ids": torch.randint(3, 512, (900,), generator=torch.Generator().manual_seed(1)).tolist()}
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4
    with pytest.raises(KvlabError, match="longer than the model's context of 1,024"):
        LLM(tiny_llama, max_model_len=2048, rope_scaling=YARN)
    assert LLM(tiny_llama, rope_scaling={"rope_type": "yarn", "factor": 4.0}).engine.max_model_len == 4 * TRAINED
    with pytest.raises(KvlabError, match="^rope_scaling: unknown rope_type 'dynamic'"):
        LLM(tiny_llama, rope_scaling={"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("text, message", [
    ("{bad", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"rope_type": "ntk", "factor": 2}', "unknown rope_type 'ntk'"),
    ('{"factor": 2}', "unknown rope_type None"),
    ('{"rope_type": "yarn"}', "needs a 'factor' of at least 1"),
    ('{"rope_type": "yarn", "factor": 0.5}', "needs a 'factor' of at least 1"),
    ('{"rope_type": "yarn", "factor": "2"}', "'factor' must be a positive number"),
    ('{"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 8192.5}', "whole number"),
    ('{"rope_type": "yarn", "factr": 2}', "unknown key 'factr'"),
])  # fmt: skip
def test_bad_rope_scaling_is_refused_with_the_reason(text, message):
    with pytest.raises(KvlabError, match=message.replace("(", r"\(")):
        parse_rope_scaling(text)


@pytest.mark.parametrize("command", [["run", "MODEL", "hi"], ["serve", "MODEL"], ["chat", "MODEL"]])
@pytest.mark.parametrize("text", ["{bad", '{"rope_type": "dynamic", "factor": 2}'])
def test_bad_rope_scaling_flag_is_one_line_and_exit_2(command, text, tiny_llama, capsys):
    args = [str(tiny_llama) if a == "MODEL" else a for a in command]
    assert main([*args, "--rope-scaling", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error: --rope-scaling: ") and err.count("\n") == 1, err


def test_serve_plans_the_stretched_context(tiny_llama, capsys):
    import io

    from kvlab.cli import build_parser
    from kvlab.engine_cli import engine_options
    from kvlab.server.cli import print_plan

    args = build_parser().parse_args(["serve", str(tiny_llama), "--dtype", "float32", "--max-model-len", "1024",
                                      "--kv-memory", "8MB", "--rope-scaling", '{"rope_type": "yarn", "factor": 2}'])  # fmt: skip
    plan, _ = print_plan(args, engine_options(args), file=io.StringIO())
    assert plan.max_model_len == 1024
