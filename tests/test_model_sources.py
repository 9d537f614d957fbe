"""Models made elsewhere: configs as Megatron writes them, checkpoints whose vocabulary the
serving TP does not divide, and tied embeddings, each served and checked against the
reference (Megatron's GPTModel on one rank, same weights)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    convert_and_run,
    make_hf_llama,
    perturb_norms,
    run_main_job,
    save_and_run,
    save_gpt_checkpoint,
)
from tknp_megatron.config import get_preset
from tknp_megatron.launch import spawn
from tknp_megatron.models.model_config import preset_from_model_config

ROOT = Path(__file__).resolve().parents[1]
SEED = 5


def megatron_config_dump(preset) -> dict:
    """What a Megatron training run's config looks like as JSON: every JSON-representable
    ``TransformerConfig`` field of the preset's config, plus the ``GPTModel`` arguments."""
    config = preset.to_transformer_config(1, torch.float32)
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[f.name] = value
    out["activation_func"] = f"torch.nn.functional.{preset.activation.value}"
    out.update(dataclasses.asdict(preset.gpt), name=preset.name)
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny-nemotron", "tiny-qk", "llama3.1-405b", "nemotron4-340b"])
def test_full_transformer_config_round_trips(name):
    preset = get_preset(name)
    dump = megatron_config_dump(preset)
    assert len(dump) > 150  # the whole TransformerConfig, training fields included
    assert "init_method_std" in dump and "bias_dropout_fusion" in dump
    assert preset_from_model_config(json.loads(json.dumps(dump))) == preset


@pytest.mark.parametrize("key, value", [
    ("num_moe_experts", 8), ("multi_latent_attention", True), ("qk_l2_norm", True),
    ("window_size", [128, 0]), ("rotary_interleaved", True), ("softmax_type", "learnable"),
])
def test_unsupported_features_are_refused_by_name(key, value):
    dump = {**megatron_config_dump(get_preset("tiny")), key: value}
    with pytest.raises(ValueError, match="not supported by tknp-megatron: .*" + re.escape(f"({key}={value!r})")):
        preset_from_model_config(dump)


def test_the_json_megatrons_config_logger_writes_for_a_gpt_model(tmp_path):
    """``TransformerConfig(config_logger_dir=...)`` makes ``GPTModel`` write its arguments with
    Megatron's own encoder: the config under ``"config"``, dtypes as ``"torch.float32"``, the
    activation as ``"<function silu at 0x...>"``. That file is a ``--model-config`` as it is."""
    import inspect

    from megatron.core.config_logger import log_config_to_disk
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from tknp_megatron.models.model_config import load_model_config

    for name in ("tiny", "tiny-nemotron"):
        preset = get_preset(name)
        config = preset.to_transformer_config(1, torch.bfloat16)
        config.config_logger_dir = str(tmp_path / name)
        args = {k: p.default for k, p in inspect.signature(GPTModel.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
        args.update(dataclasses.asdict(preset.gpt))
        # what GPTModel.__init__ passes (its locals()), written by Megatron's own logger
        log_config_to_disk(config, {"config": config, "transformer_layer_spec": get_gpt_layer_local_spec(), **args,
                                    "__class__": GPTModel}, prefix="GPTModel", rank_str="0_0_0_0_0")
        (path,) = (tmp_path / name).glob("GPTModel.rank_*.json")
        written = json.loads(path.read_text())
        assert written["config"]["params_dtype"] == "torch.bfloat16"
        assert written["config"]["activation_func"].startswith("<function ")
        served, dtype = load_model_config(path)
        assert served == dataclasses.replace(preset, name="model-config") and dtype == torch.bfloat16


@pytest.mark.parametrize("change, message", [
    ({"activation": None}, "activation None: expected a name, one of"),
    ({"activation_func": 5}, "activation_func 5: expected a name, one of"),
    ({"activation_func": "<function tanh at 0x7f00>"}, "activation '<function tanh at 0x7f00>' unsupported"),
    ({"params_dtype": ["float32"]}, "params_dtype ['float32']: expected the name of a dtype"),
    ({"params_dtype": "torch.float8"}, "params_dtype: unknown dtype 'float8'"),
    ({"name": None}, "name None: must be text"),
    ({"num_layers": 10**400}, "num_layers 100000000000... (401 digits): over the 64-bit integers"),
])
def test_config_values_of_the_wrong_kind_are_one_line(change, message):
    dump = {**megatron_config_dump(get_preset("tiny")), "activation_func": None, "activation": "silu", **change}
    with pytest.raises(ValueError, match=re.escape(message)):
        preset_from_model_config(dump)


def test_typos_are_still_refused():
    with pytest.raises(ValueError, match=r"\['hiden_size'\]"):
        preset_from_model_config({**megatron_config_dump(get_preset("tiny")), "hiden_size": 64})


# ------------------------------------------------------------------ served checkpoints
TINY = dict(name="tiny-odd", num_layers=4, hidden_size=64, num_attention_heads=4,
            num_query_groups=2, kv_channels=16, ffn_hidden_size=160, normalization="RMSNorm",
            gated_linear_unit=True, add_bias_linear=False, activation="silu",
            max_sequence_length=512, vocab_size=211)


def save_worker(rank, world, config: dict, vocab_rows: int, ckpt_dir: str, lm_args=None, key_prefix=""):
    """A seeded Megatron GPTModel at TP=world with ``vocab_rows`` embedding rows (tied
    embeddings if the config says so), saved as a distributed checkpoint."""
    warnings.simplefilter("ignore")
    save_gpt_checkpoint(preset_from_model_config(config), world, ckpt_dir, SEED, vocab_rows, lm_args, key_prefix)


def _serve(tmp_path: Path, config: dict, vocab_rows: int, nodes: int, tp: int,
           lm_args=None, key_prefix: str = "") -> dict:
    """Save a checkpoint, then serve it with the main job (with ``--model-config`` unless
    the checkpoint carries Megatron-LM's args)."""
    ckpt, cfg = tmp_path / "ckpt", tmp_path / "model.json"
    ckpt.mkdir()
    cfg.write_text(json.dumps(config))
    spawn(save_worker, 1, (config, vocab_rows, str(ckpt), lm_args, key_prefix), timeout_s=120)
    out = tmp_path / "out.json"
    source = [] if lm_args is not None else ["--model-config", str(cfg)]
    status, stdout, stderr = run_main_job(
        "--json", out, "--load", ckpt, *source, "--nodes", nodes, "--tp", tp, "--requests", 6,
        "--output-len", 5, "--prompt-len", 3, 12, "--block-size", 4)
    assert status == 0, stdout + stderr
    return json.loads(out.read_text())


def test_vocabulary_not_divisible_by_tp(tmp_path):
    """211 rows saved at TP1, served at TP2: padded to Megatron's multiple, padded logits
    never sampled, the unpadded model's tokens."""
    report = _serve(tmp_path, TINY, 211, nodes=2, tp=2)
    assert report["match_reference"] is True, report
    assert report["completed"] == 6
    assert all(0 <= t < 211 for out in report["outputs"] for t in out)


def test_tied_embeddings(tmp_path):
    """A tied checkpoint (no output_layer.weight): the last block, on another node than
    the embedding, reads the embedding matrix as its output layer."""
    config = {**TINY, "vocab_size": 256, "share_embeddings_and_output_weights": True}
    report = _serve(tmp_path, config, 256, nodes=2, tp=1)
    assert report["match_reference"] is True, report


def test_conversion_keeps_the_checkpoint_dtype(tmp_path):
    """The converter writes the dtype the folder stores (here float32) unless told
    otherwise, says so, and records it in model_config.json."""
    pytest.importorskip("transformers")
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "mcore"
    make_hf_llama(hf_dir, None)
    cmd = [sys.executable, "-m", "tknp_megatron.tools.convert_hf_checkpoint", "--hf", str(hf_dir),
           "--out", str(out_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "float32" in proc.stdout
    assert json.loads((out_dir / "model_config.json").read_text())["params_dtype"] == "float32"


def _hf_family(folder, family: str, tied: bool):
    """A tiny random ``family`` model (transformers' own class), saved as safetensors, and
    its fp32 logits on a random sequence."""
    import transformers

    config_cls, model_cls = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "llama-gelu": ("LlamaConfig", "LlamaForCausalLM"),
    }[family]
    extra = {"mistral": {"sliding_window": 4096}, "llama-gelu": {"hidden_act": "gelu"},
             "qwen3": {"head_dim": 32}}.get(family, {})  # Qwen3: heads wider than hidden / heads
    cfg = getattr(transformers, config_cls)(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    perturb_norms(model)
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.5)
    return save_and_run(model, folder, 256)


@pytest.mark.parametrize("family, tied", [("qwen2", True), ("qwen2", False), ("qwen3", True), ("mistral", False),
                                          ("llama", True), ("llama-gelu", False)])
def test_hf_families_match_transformers(tmp_path, family, tied):
    """Converted Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, head_dim beside the
    width), Mistral, tied-embedding and GeGLU (``hidden_act`` gelu) models give
    ``transformers``' own fp32 logits through Megatron's GPTModel."""
    pytest.importorskip("transformers")
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "mcore"
    ids, expected = _hf_family(hf_dir, family, tied)
    logits, preset = spawn(convert_and_run, 1, (str(hf_dir), str(out_dir), ids), timeout_s=120)[0]
    assert preset.add_qkv_bias == (family == "qwen2")
    assert preset.qk_layernorm == (family == "qwen3")
    if family == "qwen3":
        assert preset.kv_channels == 32
    if family == "mistral":
        assert preset.gpt.max_sequence_length == 4096  # the sliding window
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def megatron_lm_args(config: dict) -> argparse.Namespace:
    """Megatron-LM's stored training arguments for ``config``'s architecture: the model
    fields under Megatron-LM's names, among the training ones a real run stores."""
    return argparse.Namespace(
        num_layers=config["num_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["ffn_hidden_size"], num_attention_heads=config["num_attention_heads"],
        group_query_attention=True, num_query_groups=config["num_query_groups"],
        kv_channels=config["kv_channels"], max_position_embeddings=config["max_sequence_length"],
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=10000,
        use_rope_scaling=False, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        squared_relu=False, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, apply_layernorm_1p=False,
        vocab_size=None, padded_vocab_size=256, make_vocab_size_divisible_by=128,
        num_experts=None, multi_latent_attention=False, qk_layernorm=config.get("qk_layernorm", False),
        # training-only arguments a real run stores too
        micro_batch_size=4, global_batch_size=256, lr=3e-4, min_lr=3e-5, weight_decay=0.1,
        clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, seq_length=512,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, train_iters=1000,
        tokenizer_type="GPT2BPETokenizer", seed=1234, ckpt_format="torch_dist",
    )


def test_qwen3_folder_served_gives_transformers_greedy_tokens(tmp_path):
    """A Qwen3 folder (QK layernorm) through ``--hf`` on 2 nodes x TP 2: the greedy tokens
    of ``transformers``' own ``generate``, and of Megatron's ``GPTModel`` on the converted
    weights (the job's reference)."""
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    _hf_family(hf_dir, "qwen3", tied=True)
    prompts = [[5, 17, 200, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9], [250, 7]]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    status, stdout, stderr = run_main_job(
        "--json", out, "--hf", hf_dir, "--nodes", 2, "--tp", 2, "--output-len", 6,
        "--prompts-file", tmp_path / "prompts.json", "--block-size", 4)
    assert status == 0, stdout + stderr
    report = json.loads(out.read_text())
    assert report["outputs"] == expected
    assert report["match_reference"] is True, report


def test_a_training_checkpoint_megatron_core_0_19_wrote_is_served(tmp_path):
    """From megatron-core 0.19 a checkpoint keeps Megatron-LM's arguments among its
    distributed files (``common_state``), not in ``common.pt``: one saved by 0.19.2 (at TP 2,
    in Megatron-LM's layout) serves with no --model-config on the installed version."""
    from tests.test_megatron_versions import megatron_env

    config = {**TINY, "vocab_size": 256}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save = ("import json, sys; from tknp_megatron.launch import spawn; "
            "from tests.test_model_sources import save_worker, megatron_lm_args; "
            "c = json.loads(sys.argv[1]); spawn(save_worker, 2, (c, 256, sys.argv[2], megatron_lm_args(c)), timeout_s=120)")
    proc = subprocess.run([sys.executable, "-c", save, json.dumps(config), str(ckpt)], env=megatron_env("0.19.2"),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(ckpt.rglob("common.pt")) and (ckpt / "iter_0001000" / "metadata.json").is_file()
    out = tmp_path / "out.json"
    status, stdout, stderr = run_main_job("--json", out, "--load", ckpt, "--nodes", 2, "--tp", 1, "--requests", 6,
                                          "--output-len", 5, "--prompt-len", 3, 12, "--block-size", 4)
    assert status == 0, stdout + stderr
    report = json.loads(out.read_text())
    assert report["match_reference"] is True and report["completed"] == 6, report


@pytest.mark.parametrize("key_prefix", ["module.", "model."])
def test_a_checkpoint_of_a_model_saved_through_a_wrapper_module(tmp_path, key_prefix):
    """NeMo 2 saves the model's keys under ``module.`` (its wrapper module's name), NeMo 1
    under ``model.``: found from the stored keys, checked and served with a --model-config
    at 2 nodes x TP 2 against the saved model's own forward."""
    from megatron.core import dist_checkpointing

    from tknp_megatron.models.checkpoint import key_prefix as found_prefix

    report = _serve(tmp_path, TINY, 256, nodes=2, tp=2, key_prefix=key_prefix)
    assert found_prefix(dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt"))) == key_prefix
    assert report["match_reference"] is True, report
    assert report["completed"] == 6
    assert "the model config needs (4, 192, 64)" in _refusal(tmp_path / "ckpt", num_query_groups=4)


def test_megatron_checkpoint_with_qk_layernorm(tmp_path):
    """Megatron's ``qk_layernorm`` (its q/k norm weights saved at TP 1 by Megatron-Core,
    Megatron-LM's arguments stored with them) served on 2 nodes x TP 2 against the saved
    model's own forward."""
    config = {**TINY, "vocab_size": 256, "qk_layernorm": True}
    report = _serve(tmp_path, config, 256, nodes=2, tp=2, lm_args=megatron_lm_args(config))
    assert report["match_reference"] is True, report
    assert report["completed"] == 6


def test_megatron_lm_training_checkpoint(tmp_path):
    """A directory as Megatron-LM's training loop leaves it (tracker file, iter_NNNNNNN/,
    args stored with it) serves with no --model-config."""
    config = {**TINY, "vocab_size": 256}
    report = _serve(tmp_path, config, 256, nodes=2, tp=1, lm_args=megatron_lm_args(config))
    assert report["match_reference"] is True, report
    assert report["completed"] == 6


# ------------------------------------------------------------------ checkpoints that do not fit
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """TINY saved at TP 2 (untied, RMSNorm, no biases), the same tied, and the same laid out
    as Megatron-LM's training loop leaves it: ``{name: directory}``."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for name, config, lm in (("untied", TINY, None), ("tied", {**TINY, "share_embeddings_and_output_weights": True},
                                                        None), ("lm", {**TINY, "vocab_size": 256}, True)):
        out[name] = root / name
        out[name].mkdir()
        lm_args = megatron_lm_args(config) if lm else None
        spawn(save_worker, 2, (config, 256, str(out[name]), lm_args), timeout_s=120)
    return out


def test_a_legacy_torch_format_checkpoint_is_refused_naming_megatrons_conversion(tmp_path):
    """Megatron-LM's per-rank ``--ckpt-format torch`` files (``mp_rank_00/model_optim_rng.pt``):
    one line saying what they are and how Megatron-LM rewrites them as a distributed checkpoint."""
    from tknp_megatron.models.source import SourceError, resolve_source

    (tmp_path / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": megatron_lm_args({**TINY, "vocab_size": 256}), "iteration": 10},
               tmp_path / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(SourceError) as err:
        resolve_source(load=str(tmp_path))
    message = str(err.value)
    assert "\n" not in message
    assert "a legacy 'torch' format checkpoint (mp_rank_00/...)" in message
    assert "--ckpt-convert-format torch_dist --ckpt-convert-save DIR" in message


def test_a_zarr_backend_checkpoint_is_refused_naming_the_backend(tmp_path):
    """Older Megatron and NeMo checkpoints (Nemotron-4 340B's release) store their tensors with
    the zarr backend, which megatron-core 0.16 and later no longer read: one line saying so."""
    from tknp_megatron.models.source import SourceError, resolve_source

    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": megatron_lm_args({**TINY, "vocab_size": 256})}, tmp_path / "common.pt")
    with pytest.raises(SourceError) as err:
        resolve_source(load=str(tmp_path))
    assert "a zarr-backend distributed checkpoint, which megatron-core 0.16 and later no longer read" in str(err.value)


def _refusal(load, **config) -> str:
    from tknp_megatron.models.source import SourceError, resolve_source

    path = Path(load).parent / "config.json"
    path.write_text(json.dumps({**TINY, **config}))
    with pytest.raises(SourceError) as err:
        resolve_source(load=str(load), model_config=str(path))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=128), "decoder.layers.self_attention.linear_qkv.weight is (4, 128, 64) in the checkpoint; "
                            "the model config needs (4, 128, 128)"),
    (dict(num_layers=6), "linear_qkv.weight is (4, 128, 64) in the checkpoint; the model config needs (6, 128, 64)"),
    (dict(num_query_groups=4), "the model config needs (4, 192, 64)"),
    (dict(ffn_hidden_size=192), "decoder.layers.mlp.linear_fc1.weight is (4, 320, 64) in the checkpoint; "
                                "the model config needs (4, 384, 64)"),
    (dict(add_bias_linear=True), "no decoder.layers.self_attention.linear_qkv.bias in the checkpoint"),
    (dict(normalization="LayerNorm"), "no decoder.layers.self_attention.linear_qkv.layer_norm_bias in the checkpoint"),
    (dict(qk_layernorm=True), "no decoder.layers.self_attention.q_layernorm.weight in the checkpoint"),
    (dict(share_embeddings_and_output_weights=True),
     "the checkpoint holds a separate output_layer.weight, but the model config ties the output layer"),
], ids=["hidden", "layers", "groups", "ffn", "biases", "layer_norm", "qk_layernorm", "tied"])
def test_a_config_that_does_not_fit_the_checkpoint_is_refused_before_any_rank(saved, change, message):
    """Read from the checkpoint's metadata in the launcher: a config whose shapes, biases,
    norms or tying differ from the stored tensors (served, it would fail in every rank, or,
    for a tie or a bias, silently serve another model)."""
    assert message in _refusal(saved["untied"], **change)


def test_a_tied_checkpoint_needs_a_tied_config(saved):
    assert "no output_layer.weight in the checkpoint (the checkpoint ties it to the embedding: set " \
           "share_embeddings_and_output_weights)" in _refusal(saved["tied"])


def test_damaged_checkpoints_are_one_line(saved, tmp_path):
    """A shard cut short or missing, a tracker naming no iteration, a ``common.pt`` that does
    not unpickle: each named in one line before any rank starts."""
    import shutil

    from tknp_megatron.models.source import SourceError, resolve_source

    def copy(name):
        dst = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(saved[name], dst)
        return dst

    cut = copy("untied")
    shard = sorted(cut.glob("*.distcp"))[-1]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    assert f"{shard}: {size // 2} bytes, the metadata needs" in _refusal(cut)
    gone = copy("untied")
    shard = sorted(gone.glob("*.distcp"))[-1]
    shard.unlink()
    assert f"{shard}: missing, the metadata needs" in _refusal(gone)
    garbage = copy("lm")
    (garbage / "latest_checkpointed_iteration.txt").write_text("abc")
    with pytest.raises(SourceError, match="latest_checkpointed_iteration.txt: holds 'abc', not an iteration"):
        resolve_source(load=str(garbage))
    pickled = copy("lm")
    (pickled / "iter_0001000" / "common.pt").write_bytes(b"not a pickle")
    with pytest.raises(SourceError, match=r"iter_0001000/common.pt: does not load \("):
        resolve_source(load=str(pickled))
    assert resolve_source(load=str(saved["lm"])).preset.num_layers == 4  # the intact one loads


@pytest.mark.parametrize("argv, message", [
    (["--hf", "{missing}", "--out", "{new}"], "--hf {missing}: no such directory"),
    (["--hf", "{hf}", "--out", "{file}"], "--out {file}: a file, not a directory"),
    (["--hf", "{hf}", "--out", "{full}"], "--out {full}: not empty; pass --force"),
    (["--hf", "{hf}", "--out", "{orphan}"], "its directory {missing} does not exist"),
], ids=["hf_missing", "out_file", "out_not_empty", "out_parent_missing"])
def test_the_converter_refuses_bad_paths_in_one_line(tmp_path, capsys, argv, message):
    from tknp_megatron.tools.convert_hf_checkpoint import main

    paths = dict(missing=tmp_path / "missing", new=tmp_path / "new", hf=tmp_path / "hf", file=tmp_path / "file",
                 full=tmp_path / "full", orphan=tmp_path / "missing" / "out")
    make_hf_llama(paths["hf"], None)
    paths["file"].write_text("x")
    paths["full"].mkdir()
    (paths["full"] / "kept").write_text("x")
    capsys.readouterr()  # transformers' progress bar
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("convert_hf_checkpoint: error: ") and "\n" not in err, err
    assert message.format(**paths) in err
    assert (paths["full"] / "kept").read_text() == "x" and not paths["new"].exists()


def test_megatron_lm_args_refuse_unsupported_features():
    from tknp_megatron.models.model_config import preset_from_checkpoint_args

    args = megatron_lm_args({**TINY, "vocab_size": 256})
    assert preset_from_checkpoint_args(args).num_query_groups == 2
    args.num_experts = 8
    with pytest.raises(ValueError, match=r"mixture of experts \(num_experts=8\)"):
        preset_from_checkpoint_args(args)


def test_args_an_older_megatron_lm_did_not_store_take_its_defaults():
    from tknp_megatron.models.model_config import preset_from_checkpoint_args

    args = megatron_lm_args({**TINY, "vocab_size": 256})
    full = preset_from_checkpoint_args(args)
    for key in ("normalization", "rotary_base", "rotary_percent", "apply_layernorm_1p", "add_qkv_bias"):
        delattr(args, key)
    old = preset_from_checkpoint_args(args)
    assert old.normalization == "LayerNorm" and old.gpt.rotary_base == 10000 and old.gpt.rotary_percent == 1.0
    assert dataclasses.replace(old, normalization=full.normalization, gpt=full.gpt) == full


def test_squared_relu_is_eager():
    """Nemotron's activation must not be Megatron's torch.compile'd one: compiling on the
    first decode steps stalled every run by seconds."""
    from tknp_megatron.config import Activation

    fn = Activation.SQUARED_RELU.fn()
    assert not hasattr(fn, "_torchdynamo_orig_callable")
    x = torch.randn(64)
    torch.testing.assert_close(fn(x), torch.nn.functional.relu(x) ** 2, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(rotary_percent=0.5), "rotary_percent 0.5, but the checkpoint {load} was saved with 1.0"),
    (dict(num_attention_heads=8, num_query_groups=4, kv_channels=8),  # the same shapes, another head split
     "num_attention_heads 8, but the checkpoint {load} was saved with 4"),
], ids=["rotary_percent", "head_split"])
def test_a_config_against_the_args_stored_with_the_checkpoint(saved, change, message):
    """What shapes cannot show (RoPE, the split of a width into heads, the tokenizer's
    vocabulary within the padded rows) is compared with the arguments Megatron-LM stored
    with the checkpoint, where it stored them."""
    load = saved["lm"]
    assert message.format(load=load) in _refusal(load, **{"vocab_size": 256, **change})


def test_a_config_may_not_cut_the_vocabulary_the_checkpoint_names(saved, tmp_path):
    """A checkpoint that names its tokenizer's vocabulary (the converter's model_config.json)
    refuses a config with fewer tokens: the rest could never be sampled. Megatron-LM's
    arguments usually store only the padded rows, and a smaller vocabulary is then the
    normal case (the rows include the padding)."""
    from tknp_megatron.models.source import resolve_source

    load = tmp_path / "described"
    shutil.copytree(saved["untied"], load)
    (load / "model_config.json").write_text(json.dumps(TINY))  # 211 tokens in 256 rows
    assert (f"vocab_size 200, but the checkpoint {load} was saved with 211 tokens: the ones from 200 on "
            "could never be sampled") in _refusal(load, vocab_size=200)
    config = tmp_path / "larger.json"
    config.write_text(json.dumps({**TINY, "vocab_size": 240}))
    assert resolve_source(load=str(load), model_config=str(config)).preset.vocab_size == 240
    config.write_text(json.dumps({**TINY, "vocab_size": 200}))  # the rows are all the lm checkpoint says
    assert resolve_source(load=str(saved["lm"]), model_config=str(config)).preset.vocab_size == 200


def test_a_stored_tensor_of_a_feature_the_config_lacks_is_refused(saved):
    """Learned position embeddings or q/k layernorm weights in a checkpoint whose config has
    neither would be skipped by the load, and the tokens would be another model's; the
    optimizer's state and Transformer Engine's extra state are not weights of the model."""
    from megatron.core import dist_checkpointing

    from tknp_megatron.models.checkpoint import _layout_problems
    from tknp_megatron.models.model_config import preset_from_model_config

    meta = dist_checkpointing.load_tensors_metadata(str(saved["untied"]))
    stored = {k: tuple(v.global_shape) for k, v in meta.items()}
    preset = preset_from_model_config(dict(TINY))
    assert _layout_problems(stored, preset) == []
    ignored = {"optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight": (4, 64, 160),
               "decoder.layers.self_attention.core_attention._extra_state": (4,)}
    assert _layout_problems({**stored, **ignored}, preset) == []
    key, shape = "embedding.position_embeddings.weight", (512, 64)
    (problem,) = _layout_problems({**stored, key: shape}, preset)
    assert problem.startswith(f"the checkpoint holds {key} {shape}, which a model of this config does not have")
    key, shape = "decoder.layers.self_attention.q_layernorm.weight", (4, 16)  # a feature the config can turn on
    (problem,) = _layout_problems({**stored, key: shape}, preset)
    assert problem == (f"the checkpoint holds {key} {shape}, which the model config does not have "
                       "(add_bias_linear, add_qkv_bias, normalization, qk_layernorm)")
