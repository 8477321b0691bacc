"""Tokenizers for `dtlab prepare` and `dtlab sample`: text <-> token ids, and how to find the same
tokenizer again from a token directory's meta.json.

- `bytes` (the default): UTF-8 bytes, vocabulary 256, nothing to download; fits the GPT configs.
- a local Hugging Face tokenizer: a directory holding tokenizer.json (or the file itself), read
  with the `tokenizers` package (the `hf` extra); documents end with its end-of-text token.
- `gpt2`: tiktoken's GPT-2 encoding (50,257 ids, `<|endoftext|>` between documents), when
  tiktoken and its encoding file are available (tiktoken downloads it once, then caches it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from dtlab.errors import ConfigError, DataError

# Names a tokenizer's end-of-text token has, in the order they are looked for.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class Tokenizer(Protocol):
    vocab_size: int
    eos: int | None  # appended after each document, None = documents are simply concatenated

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def spec(self) -> dict[str, Any]: ...


class ByteTokenizer:
    vocab_size, eos = 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, Any]:
        return {"kind": "bytes"}


class HFTokenizer:
    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as Fast
        except ImportError:
            raise ConfigError("a Hugging Face tokenizer needs the `tokenizers` package; fix: "
                              "pip install 'dtlab[hf]'") from None
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer {path}: no tokenizer.json there; fix: pass a "
                              "Hugging Face tokenizer directory (tokenizer.json), 'bytes' or 'gpt2'")
        try:
            self.tok = Fast.from_file(str(file))
        except Exception as e:  # the library raises its own error types for a damaged file
            raise DataError(f"{file} is not a tokenizer the `tokenizers` package reads ({e}); "
                            "fix: save it with tokenizer.save_pretrained(DIR)") from None
        self.path = file.resolve()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos = next((i for i in map(self.tok.token_to_id, EOS_NAMES) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def spec(self) -> dict[str, Any]:
        return {"kind": "hf", "path": str(self.path)}


class TiktokenGPT2:
    def __init__(self) -> None:
        try:
            import tiktoken

            self.enc = tiktoken.get_encoding("gpt2")
        except ImportError:
            raise ConfigError("--tokenizer gpt2 needs tiktoken; fix: pip install tiktoken, or "
                              "use --tokenizer bytes or a local tokenizer directory") from None
        except Exception as e:  # no network and no cached encoding file
            raise DataError(f"tiktoken could not load its GPT-2 encoding ({type(e).__name__}); "
                            "fix: run once where it can download it, or use --tokenizer bytes or "
                            "a local tokenizer directory") from None
        self.vocab_size, self.eos = self.enc.n_vocab, self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def spec(self) -> dict[str, Any]:
        return {"kind": "gpt2"}


def load(name: str) -> Tokenizer:
    """`bytes`, `gpt2`, or the path of a Hugging Face tokenizer (directory or tokenizer.json)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenGPT2()
    return HFTokenizer(Path(name))


def from_meta(folder: Path) -> Tokenizer | None:
    """The tokenizer a token directory was prepared with (its meta.json), None when unknown."""
    meta = Path(folder) / "meta.json"
    try:
        spec = json.loads(meta.read_text()).get("tokenizer") if meta.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(spec, dict):
        return None
    return load(spec["path"] if spec.get("kind") == "hf" else str(spec.get("kind")))
