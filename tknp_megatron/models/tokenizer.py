"""Text <-> token ids for the main job, from a Hugging Face tokenizer folder on local disk.

:class:`Tokenizer` reads the folder with ``transformers.AutoTokenizer`` (local files only,
nothing is downloaded) and falls back to the ``tokenizers`` library's
``tokenizer.json`` when ``transformers`` is missing or cannot read the folder (e.g. no
``tokenizer_config.json``). Prompts are encoded *without* special tokens, except that a
BOS is kept when the tokenizer puts one in front by default (Llama's ``<s>`` /
``<|begin_of_text|>``): the model was trained to see it, so leaving it out changes the
output. EOS, when the tokenizer names one, is what stops generation, and so does every other
end-of-sequence id the folder's ``generation_config.json`` lists (:attr:`Tokenizer.stop_ids`:
Llama-3 and Qwen2.5 instruct folders list two or three), as ``transformers``' ``generate``
stops at each.

:class:`Tokenizer` also has the interface Megatron-Core's inference server and
coordinator call (``tokenize`` / ``detokenize`` / ``apply_chat_template`` / ``chat_template`` / ``eod`` / ``bos`` /
``vocab_size``, as ``megatron.core.tokenizers`` tokenizers have) and pickles as its folder, so the same object
serves the main job and Megatron's server processes. :func:`server_tokenizer` gives a model
without a tokenizer folder Megatron's own null tokenizer (text is space-separated ids).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

__all__ = ["Tokenizer", "server_tokenizer"]

PathLike = Union[str, os.PathLike]
_PROBE = "a"  # any ordinary text: shows whether encoding puts a BOS in front


def _load_hf(folder: Path) -> Optional[Any]:
    """``AutoTokenizer`` from ``folder``, or None when transformers cannot read it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _generation_eos(folder: Path) -> Tuple[int, ...]:
    """``eos_token_id`` of the folder's ``generation_config.json`` (an id or a list of them),
    the ids that are whole numbers; () without the file or the key."""
    path = folder / "generation_config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.is_file() else None
    except (ValueError, AttributeError):
        return ()
    ids = value if isinstance(value, list) else [value]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def _special_token(folder: Path, name: str) -> Optional[str]:
    """``bos_token`` / ``eos_token`` as written in the folder's config files, if any."""
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / fname
        if not path.exists():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get(name)
        if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...}
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


class Tokenizer:
    """A Hugging Face tokenizer folder, read from local files only.

    Args:
        folder: directory with ``tokenizer.json`` (and usually ``tokenizer_config.json``).

    Attributes:
        eos_id: end-of-sequence token id, or None when the tokenizer has none.
        stop_ids: the other ids that end a sequence: those ``generation_config.json``'s
            ``eos_token_id`` lists besides ``eos_id`` (``transformers``' ``generate`` stops at
            each), within the vocabulary.
        bos_id: beginning-of-sequence token id, or None.
        vocab_size: number of token ids, added tokens included (ids are ``< vocab_size``).
    """

    def __init__(self, folder: PathLike):
        self.folder = Path(folder)
        self._hf = _load_hf(self.folder)
        self._raw = None
        if self._hf is None:
            path = self.folder / "tokenizer.json"
            if not path.exists():
                raise FileNotFoundError(f"{self.folder}: no tokenizer transformers can read "
                                        "and no tokenizer.json")
            from tokenizers import Tokenizer as RawTokenizer

            self._raw = RawTokenizer.from_file(str(path))
        self.bos_id = self._token_id("bos")
        self.eos_id = self._token_id("eos")
        self.stop_ids = tuple(i for i in dict.fromkeys(_generation_eos(self.folder))
                              if i != self.eos_id and i < self.vocab_size)
        self._prepend_bos = self.bos_id is not None and self._encode(_PROBE, True)[:1] == [self.bos_id]

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self._raw.get_vocab_size(with_added_tokens=True)

    def _token_id(self, kind: str) -> Optional[int]:
        if self._hf is not None:
            return getattr(self._hf, f"{kind}_token_id", None)
        token = _special_token(self.folder, f"{kind}_token")
        return None if token is None else self._raw.token_to_id(token)

    def _encode(self, text: str, special: bool) -> List[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=special))
        return list(self._raw.encode(text, add_special_tokens=special).ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """``text`` -> token ids.

        With ``add_special_tokens=False`` (the default) no special tokens are added, except
        the BOS that the tokenizer itself puts in front by default (Llama-style). With
        True, whatever the tokenizer's own post-processing adds (BOS, EOS, ...).
        """
        if add_special_tokens:
            return self._encode(text, True)
        ids = self._encode(text, False)
        return [self.bos_id] + ids if self._prepend_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text; special tokens (BOS, EOS, padding) are dropped by default."""
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._raw.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------ Megatron's tokenizer interface
    def tokenize(self, text: str) -> List[int]:
        """Megatron's name for :meth:`encode` (BOS as the tokenizer puts it by default)."""
        return self.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Megatron's name for :meth:`decode` (special tokens dropped)."""
        return self.decode(ids)

    def apply_chat_template(self, conversation, chat_template: Optional[str] = None, tokenize: bool = True,
                            **kwargs) -> Union[str, List[int]]:
        """Megatron's ``apply_chat_template`` (its chat endpoint calls it): the conversation
        through the folder's chat template (``transformers``' own rendering), as a list of
        token ids when ``tokenize``, else the text. ``AttributeError`` (which Megatron's
        endpoint reports as "no chat template") without ``transformers`` or a template."""
        template = chat_template or getattr(self._hf, "chat_template", None)
        if self._hf is None or not template:
            raise AttributeError(f"{self.folder}: the tokenizer has no chat template")
        kwargs.pop("return_dict", None)  # ids or text, never a BatchEncoding (msgpack carries lists)
        out = self._hf.apply_chat_template(conversation, chat_template=template, tokenize=tokenize,
                                           return_dict=False, **kwargs)
        return [int(t) for t in out] if tokenize else out

    @property
    def chat_template(self) -> Optional[str]:
        """The folder's chat template, or None: megatron-core 0.17 and later render chat
        messages through :meth:`apply_chat_template` only where this is set (and join the
        messages' text otherwise)."""
        return getattr(self._hf, "chat_template", None) if self._hf is not None else None

    @property
    def eod(self) -> Optional[int]:
        """End of document: the EOS id."""
        return self.eos_id

    @property
    def bos(self) -> Optional[int]:
        return self.bos_id

    def __getstate__(self):
        return {"folder": str(self.folder)}  # reloaded in the receiving process

    def __setstate__(self, state):
        self.__init__(state["folder"])

    def __repr__(self) -> str:
        kind = "transformers" if self._hf is not None else "tokenizers"
        return f"Tokenizer({str(self.folder)!r}, {kind}, vocab {self.vocab_size}, eos {self.eos_id})"


def server_tokenizer(folder: Optional[PathLike], vocab_size: int):
    """The tokenizer Megatron's server and coordinator use: :class:`Tokenizer` of
    ``folder``, or without one Megatron's null tokenizer over ``vocab_size`` ids (prompts
    are space-separated ids; its ``eod`` is the last id, ``vocab_size - 1``)."""
    if folder:
        return Tokenizer(folder)
    from megatron.core.tokenizers import MegatronTokenizer

    # megatron-core 0.18+ names it "null-text" and counts the eod in vocab_size; 0.17 names
    # it so and adds the eod after vocab_size ids, as 0.16 does, which names it "null"
    for library, size in (("null-text", vocab_size), ("null-text", vocab_size - 1), ("null", vocab_size - 1)):
        try:
            tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=size)
        except (AssertionError, KeyError, ValueError, AttributeError):
            continue
        if tokenizer.eod == vocab_size - 1:
            return tokenizer
    raise RuntimeError(f"megatron-core {_megatron_version()}: no null tokenizer over {vocab_size} ids")


def _megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__
