"""Start-up stays fast: the command line parses its arguments without importing torch, and a model's tokenizer
loads from tokenizer.json without importing transformers, yet encodes and decodes exactly as transformers does."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from offload_engine.tokenizer import load_tokenizer
from tests.conftest import with_tokenizer_config

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["The quick brown fox", "offload<|endoftext|> engine", "<|endoftext|>", "héllo wörld — 日本語 🙂",
         "  two  spaces, then punctuation !", "", "a<|endoftext|><|endoftext|>b", "x<|im_start|>y"]
HEAVY = ("torch", "transformers", "numba")


def _heavy_modules_after(code: str) -> list[str]:
    """Runs `code` in a fresh interpreter and returns which heavy modules it imported."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def _cli(*argv: str) -> str:
    return (f"import sys, runpy\nsys.argv = ['offload-engine', *{list(argv)!r}]\n"
            "try:\n    runpy.run_module('offload_engine.cli', run_name='__main__')\nexcept SystemExit:\n    pass")


@pytest.mark.parametrize("argv", [("--help",), ("generate", "--help"), ("generate", "--no-such-flag")])
def test_cli_parses_without_importing_torch(argv):
    assert _heavy_modules_after(_cli(*argv)) == []


def test_importing_the_package_imports_no_torch():
    assert _heavy_modules_after("import offload_engine") == []


def test_tokenizer_loads_and_encodes_without_transformers(text_model_dir):
    code = (f"from offload_engine.tokenizer import load_tokenizer\ntok = load_tokenizer({text_model_dir!r})\n"
            "assert tok.decode(tok.encode('The quick brown fox')) == 'The quick brown fox'")
    assert _heavy_modules_after(code) == []


@pytest.fixture(scope="module")
def declared_token_dir(text_model_dir, tmp_path_factory):
    """The text model with a special token declared only in tokenizer_config.json, as some checkpoints ship it."""
    declared = {"5000": {"content": "<|im_start|>", "special": True, "lstrip": False, "rstrip": False,
                         "normalized": False, "single_word": False}}
    return with_tokenizer_config(text_model_dir, tmp_path_factory.mktemp("tok") / "model",
                                 added_tokens_decoder=declared)


@pytest.mark.parametrize("which", ["text model", "token declared in tokenizer_config.json"])
def test_encode_and_decode_match_transformers(text_model_dir, declared_token_dir, which):
    from transformers import AutoTokenizer

    model_dir = text_model_dir if which == "text model" else declared_token_dir
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.eos_token_id == theirs.eos_token_id is not None
    assert ours.vocab_size == len(theirs)


def test_transformers_tokenizer_loads_once_and_renders_chat_templates(text_model_dir):
    tok = load_tokenizer(text_model_dir)
    assert tok.hf() is tok.hf()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert text == "<user>hi"


def test_no_tokenizer_files_means_no_tokenizer(qwen3_dir):
    assert load_tokenizer(qwen3_dir) is None
