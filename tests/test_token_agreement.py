"""tknp_megatron.tools.token_agreement on CPU (gloo, fp32): a checkpoint served in every
mode it runs (TKNP, DP, PP; prompts prefilled in the pool) agrees token for token with the
reference model's greedy tokens. On the GPU the same tool measures bf16 agreement."""

import json
import warnings

import pytest

from tests.helpers import save_gpt_checkpoint
from tknp_megatron.launch import spawn
from tknp_megatron.tools import token_agreement

CONFIG = dict(name="tiny-ckpt", num_layers=4, hidden_size=64, num_attention_heads=4,
              num_query_groups=2, kv_channels=16, ffn_hidden_size=160, normalization="RMSNorm",
              gated_linear_unit=True, add_bias_linear=False, activation="silu", vocab_size=256,
              max_sequence_length=256)
PROMPTS = [[5, 17, 200, 2], [9, 9, 1, 44, 100, 3, 7], [250], [30, 31, 32]]


def save_and_expect(rank, world, ckpt_dir):
    """Save a seeded checkpoint; the reference's greedy tokens for PROMPTS."""
    warnings.simplefilter("ignore")
    import parallel_state as ps
    from tknp_megatron.models.checkpoint import load_megatron_checkpoint
    from tknp_megatron.models.model_config import preset_from_model_config
    from tknp_megatron.models.reference import build_reference_model, reference_generate
    from tknp_megatron.sampling import SamplingParams

    preset = preset_from_model_config(CONFIG)
    save_gpt_checkpoint(preset, 1, ckpt_dir, seed=4)
    ps.initialize_model_parallel(1)
    model = build_reference_model(preset)
    load_megatron_checkpoint(model, ckpt_dir)
    params = [SamplingParams(max_new_tokens=n) for n in (6, 3, 8, 5)]
    out = [list(r.tokens) for r in reference_generate(model, preset, PROMPTS, params)]
    ps.destroy_model_parallel()
    return out


@pytest.mark.timeout(400)  # its pool, in this process, would otherwise wait out the tool's 30 minutes
def test_every_mode_agrees_in_fp32(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    expected = spawn(save_and_expect, 1, (str(ckpt),), timeout_s=120)[0]
    (ckpt / "model_config.json").write_text(json.dumps(CONFIG))
    data = tmp_path / "expected.json"
    data.write_text(json.dumps(dict(prompts=PROMPTS, tokens=expected)))
    out = tmp_path / "rows.json"
    # the tool's own entry point, in this process (its pool is spawned as from the shell)
    assert token_agreement.main(["--load", str(ckpt), "--expected", str(data), "--device", "cpu",
                                 "--dtype", "float32", "--kv-tokens-per-node", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["tknp", "dp", "pp"]
    for r in rows:
        assert r["outputs"] == expected, r["mode"]
        assert r["token_match_rate"] == r["first_token_match_rate"] == 1.0
