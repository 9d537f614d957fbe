"""Tokenizer wrapper over a tiny BPE tokenizer trained here (no downloads).

The folder holds ``tokenizer.json`` plus a minimal ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast``, so ``AutoTokenizer`` reads it; the ``tokenizers`` fallback
(transformers missing or unable to read the folder) is tested by disabling the first path. Text round-trips through encode/decode,
BOS is kept only when the tokenizer adds it by default, EOS is found.
"""

from __future__ import annotations

import pytest

from tests.helpers import CHAT_TEMPLATE, make_tiny_tokenizer
from tknp_megatron.models import tokenizer as tokenizer_module
from tknp_megatron.models.tokenizer import Tokenizer

TEXT = "the quick model decodes tokens over nodes"


@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
def test_round_trip(tmp_path, monkeypatch, backend):
    pytest.importorskip("tokenizers")
    if backend == "transformers":
        pytest.importorskip("transformers")
    else:  # as if transformers were missing or could not read the folder
        monkeypatch.setattr(tokenizer_module, "_load_hf", lambda folder: None)
    tok = Tokenizer(make_tiny_tokenizer(tmp_path))
    assert (tok._hf is not None) == (backend == "transformers")
    ids = tok.encode(TEXT)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert 1 not in ids and 2 not in ids  # no special tokens unless asked
    assert tok.decode(ids) == TEXT
    assert tok.eos_id == 2 and tok.bos_id == 1  # named in tokenizer_config.json
    assert tok.decode(ids + [tok.eos_id]) == TEXT  # EOS dropped from the text
    assert 30 < tok.vocab_size <= 200  # specials + letters + merges


def test_bos_kept_when_added_by_default(tmp_path):
    pytest.importorskip("transformers")
    plain = Tokenizer(make_tiny_tokenizer(tmp_path / "plain"))
    llama_like = Tokenizer(make_tiny_tokenizer(tmp_path / "bos", bos=True))
    ids = plain.encode(TEXT)
    assert llama_like.bos_id == 1
    assert llama_like.encode(TEXT) == [1] + ids
    assert llama_like.decode(llama_like.encode(TEXT)) == TEXT
    assert plain.encode(TEXT, add_special_tokens=True) == ids  # its post-processing adds none


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_chat_template_as_megatrons_chat_endpoint_calls_it(tmp_path):
    """``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``, as
    Megatron's chat endpoint calls it: transformers' own ids, as a list of ints; no template,
    AttributeError (which that endpoint reports as such). ``chat_template`` names the
    template (megatron-core 0.17+ applies one only where it is set) or is None."""
    transformers = pytest.importorskip("transformers")
    folder = make_tiny_tokenizer(tmp_path / "chat", chat_template=CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "the quick model"}, {"role": "user", "content": "decodes tokens"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tok = Tokenizer(folder)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == hf(expected, add_special_tokens=False)["input_ids"] and ids[0] == tok.bos_id
    assert tok.chat_template == hf.chat_template == CHAT_TEMPLATE
    plain = Tokenizer(make_tiny_tokenizer(tmp_path / "plain"))
    assert plain.chat_template is None
    with pytest.raises(AttributeError, match="no chat template"):
        plain.apply_chat_template(messages)



def test_generation_configs_end_ids_end_a_sequence_as_transformers_generate_ends_it(tmp_path):
    """Llama-3 and Qwen2.5 instruct folders list several end ids in ``generation_config.json``
    (transformers' ``generate`` stops at each); the tokenizer's EOS is one of them. The others
    are the tokenizer's ``stop_ids``, which end a served request (with the tokenizer's default
    end: no ``termination_id``) and the main job's requests."""
    from tknp_megatron.serving.megatron_types import to_engine_request

    folder = make_tiny_tokenizer(tmp_path / "tok")
    eos = Tokenizer(folder).eos_id
    assert Tokenizer(folder).stop_ids == ()
    (folder / "generation_config.json").write_text(f'{{"eos_token_id": [{eos}, 7, 7, 9, "x", 100000]}}')
    tok = Tokenizer(folder)
    assert tok.eos_id == eos and tok.stop_ids == (7, 9)  # deduplicated, outside the vocabulary dropped
    req = to_engine_request([1, 2], {"num_tokens_to_generate": 4}, tok, 64)
    assert req.params.eos_id == eos and req.params.stop_sequences == ((7,), (9,))
    req = to_engine_request([1, 2], {"num_tokens_to_generate": 4, "termination_id": 3, "stop_words": None}, tok, 64)
    assert req.params.eos_id == 3 and req.params.stop_sequences == ()  # an explicit end: only that one
    (folder / "generation_config.json").write_text('{"eos_token_id": 9}')
    assert Tokenizer(folder).stop_ids == (9,)

    from tests.helpers import load_job_module

    job = load_job_module()
    args = job.parse_args(["--tokenizer", str(folder), "--prompt", "a b", "--output-len", "4"])
    params = job.prepare_job(args).sampling()
    assert params.eos_id == eos and params.stop_sequences == ((9,),)
