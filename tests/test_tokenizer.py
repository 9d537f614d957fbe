"""Tokenizer wrapper over a tiny BPE tokenizer trained here (no downloads).

The folder holds ``tokenizer.json`` plus a minimal ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast``, so ``AutoTokenizer`` reads it; the ``tokenizers`` fallback
(transformers missing or unable to read the folder) is tested by disabling the first path. Text round-trips through encode/decode,
BOS is kept only when the tokenizer adds it by default, EOS is found.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tknp_megatron.models import tokenizer as tokenizer_module
from tknp_megatron.models.tokenizer import Tokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "token parallel decode spreads requests over nodes",
    "every node keeps the cache of the requests it owns",
    "megatron core builds the layers of the model",
    "a small model answers with a few tokens",
] * 4
TEXT = "the quick model decodes tokens over nodes"


def make_tiny_tokenizer(folder, vocab_size: int = 200, bos: bool = False) -> Path:
    """Train a BPE tokenizer (Metaspace, ~``vocab_size`` ids) on :data:`SENTENCES`; save a HF folder.

    Special tokens ``<unk>`` (0), ``<s>`` (1), ``</s>`` (2). ``bos``: a post-processor
    puts ``<s>`` in front of every encoding, as Llama's tokenizers do.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(SENTENCES, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", add_bos_token=bos)))
    return folder


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
