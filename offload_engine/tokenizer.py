"""A model directory's tokenizer, loaded without transformers where the directory has a tokenizer.json.

Importing transformers takes seconds; the `tokenizers` library reads tokenizer.json in milliseconds and is what
transformers' fast tokenizers run on. `load_tokenizer` builds the pipeline transformers builds from tokenizer.json and
tokenizer_config.json (declared added and special tokens; no truncation or padding), so `encode` and `decode` give
transformers' ids and text. (A few model-specific transformers classes rebuild their pipeline in code rather than
from tokenizer.json; for those, `hf()` is the reference.) transformers is imported only when asked for: `hf()` (and
chat templates, which it renders), or a directory with no tokenizer.json (a slow, sentencepiece-only tokenizer).
"""
from __future__ import annotations

import json
import os
import typing

if typing.TYPE_CHECKING:
    import tokenizers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The special tokens transformers names in tokenizer_config.json / special_tokens_map.json.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_LISTED_SPECIAL_TOKENS = ("additional_special_tokens", "extra_special_tokens")


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has neither tokenizer.json nor tokenizer_config.json."""
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    settings = _tokenizer_settings(model_dir)
    path = os.path.join(model_dir, "tokenizer.json")
    fast = _fast_tokenizer(path, settings) if os.path.isfile(path) else None
    return Tokenizer(model_dir, fast, settings)


class Tokenizer:
    """Text to token ids and back, as `transformers.AutoTokenizer.from_pretrained(model_dir)` does it.

    `fast` is the tokenizers pipeline built from tokenizer.json, or None, in which case every call goes to `hf()`.
    `eos_token_id`: the id of tokenizer_config.json's eos_token, None where it names none. `vocab_size`: every id
    `encode` can return, added tokens included (len() of the transformers tokenizer)."""

    def __init__(self, model_dir: str, fast: tokenizers.Tokenizer | None, settings: dict):
        self.model_dir = model_dir
        self._fast = fast
        self._settings = settings
        self._hf = None
        self._clean_up_spaces = _cleans_up_spaces(fast, settings)
        self.eos_token_id = self._token_id(settings.get("eos_token"))

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with the special tokens the tokenizer adds around a sequence (BOS, say)."""
        if self._fast is None:
            return self.hf().encode(text)
        return self._fast.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self._fast is None:
            return self.hf().decode(ids, skip_special_tokens=skip_special_tokens)
        text = self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    @property
    def vocab_size(self) -> int:
        return len(self.hf()) if self._fast is None else self._fast.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def hf(self):
        """transformers' tokenizer for the same directory, loaded on the first call (it imports transformers)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.model_dir)
        return self._hf

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs):
        """transformers' `apply_chat_template` (the template is Jinja, rendered by transformers)."""
        return self.hf().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=tokenize, **kwargs)

    def _token_id(self, token) -> int | None:
        content = _content(token)
        if content is None:
            return None
        if self._fast is None:
            return self.hf().convert_tokens_to_ids(content)
        return self._fast.token_to_id(content)


def _tokenizer_settings(model_dir: str) -> dict:
    """tokenizer_config.json over special_tokens_map.json (older checkpoints keep the special tokens there)."""
    settings = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            settings.update(_read_json(path))
    return settings


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OSError(f"{path} is not valid JSON ({error}): re-download it or fix the file") from None
    if not isinstance(value, dict):
        raise OSError(f"{path} holds a JSON {type(value).__name__}, not an object: re-download it or fix the file")
    return value


def _fast_tokenizer(path: str, settings: dict) -> tokenizers.Tokenizer:
    """tokenizer.json's pipeline with transformers' additions from tokenizer_config.json applied. Its post-processor
    alone decides which special tokens `encode` adds: transformers ignores tokenizer_config.json's add_bos_token and
    add_eos_token where a tokenizer.json exists."""
    import tokenizers

    try:
        fast = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        raise OSError(f"{path} is not a readable tokenizer.json ({error}): re-download it") from None
    fast.no_truncation()  # transformers' encode() switches off whatever the file sets
    fast.no_padding()
    _add_missing_tokens(fast, settings)
    return fast


def _add_missing_tokens(fast: tokenizers.Tokenizer, settings: dict) -> None:
    """Adds what tokenizer_config.json declares and tokenizer.json lacks: its added_tokens_decoder entries and its
    named special tokens, as transformers does on load (so they encode as one id and decode() can skip them)."""
    import tokenizers

    declared = [_added_token(entry) for _, entry in sorted(settings.get("added_tokens_decoder", {}).items(),
                                                              key=lambda item: int(item[0]))]
    named = [tokenizers.AddedToken(content, special=True) for content in _special_token_contents(settings)]
    known = {token.content for token in fast.get_added_tokens_decoder().values()}
    for token in declared + named:
        if token.content not in known:
            fast.add_tokens([token])
            known.add(token.content)


def _added_token(entry: dict) -> tokenizers.AddedToken:
    import tokenizers

    options = {key: entry[key] for key in ("single_word", "lstrip", "rstrip", "normalized", "special") if key in entry}
    return tokenizers.AddedToken(entry["content"], **options)


def _special_token_contents(settings: dict) -> list[str]:
    named = [_content(settings.get(key)) for key in _NAMED_SPECIAL_TOKENS]
    listed = [_content(token) for key in _LISTED_SPECIAL_TOKENS for token in _as_list(settings.get(key))]
    return [content for content in named + listed if content]


def _as_list(value) -> list:
    if isinstance(value, dict):  # extra_special_tokens may map names to tokens
        return list(value.values())
    return list(value or [])


def _content(token) -> str | None:
    """A special token's text: tokenizer_config.json writes it as a string or as a serialized AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _cleans_up_spaces(fast: tokenizers.Tokenizer | None, settings: dict) -> bool:
    """transformers removes spaces before punctuation on decode when clean_up_tokenization_spaces is set, except for
    BPE models, where that would corrupt the text."""
    if fast is None or not settings.get("clean_up_tokenization_spaces", False):
        return False
    return type(fast.model).__name__ != "BPE"


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization, for WordPiece-style output."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
