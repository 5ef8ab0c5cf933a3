"""Which tokenizer a run uses, and a byte-level one that needs no files.

``load_tokenizer(spec, model_path)`` picks, in order:

1. ``spec == "byte"``: the built-in byte tokenizer;
2. ``spec`` a path or a name: ``AutoTokenizer.from_pretrained(spec)`` (local files only);
3. no ``spec``: the tokenizer saved with the model in ``model_path``, if it has one;
4. otherwise the byte tokenizer, so a model trained from scratch needs nothing downloaded.

The byte tokenizer is a real ``transformers`` fast tokenizer (ids 0-255 are the
byte values, then ``<|bos|>``, ``<|eos|>``, ``<|pad|>``): ``save_pretrained``
writes it next to a checkpoint and ``AutoTokenizer`` loads it back, so exported
models work with the usual Hugging Face tools.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from zerotrain.train.data.errors import DataError

BYTE = "byte"
BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")

# Files of which at least one means "a tokenizer was saved here".
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def byte_tokenizer() -> Any:
    """The byte-level tokenizer: 256 byte tokens (id == byte value) plus three specials.

    Built as a BPE model without merges over the GPT-2 byte-to-unicode alphabet,
    so any UTF-8 text encodes losslessly and ``decode(encode(s)) == s``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: with no merges word splitting changes nothing and only costs time.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    bos, eos, pad = BYTE_SPECIALS
    core.add_special_tokens(list(BYTE_SPECIALS))
    # Like Llama's tokenizer, `tokenizer(text)` starts with BOS; the data pipeline
    # adds its own specials and encodes with add_special_tokens=False.
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 256)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        clean_up_tokenization_spaces=False,  # cleanup rewrites " ." as "." and breaks round trips
        name_or_path=BYTE,
        model_max_length=int(1e30),  # bytes have no length limit; the model's positions do
    )


def has_tokenizer(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding tokenizer files."""
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(spec: str | None, model_path: str | None, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer named by ``spec``, else the one saved with ``model_path``, else the byte one.

    Raises ``DataError`` when ``spec`` names a tokenizer that cannot be loaded from local files.
    """
    if spec == BYTE:
        return byte_tokenizer()
    if spec:
        return _auto(spec, trust_remote_code, key="the tokenizer setting")
    if model_path and has_tokenizer(model_path):
        return _auto(model_path, trust_remote_code, key="the model path")
    return byte_tokenizer()


def _auto(name: str, trust_remote_code: bool, key: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, ... for a missing tokenizer
        raise DataError(
            f"cannot load a tokenizer from {name!r} ({key}): {e}\n"
            "Give a directory with tokenizer files (tokenizer.json or tokenizer_config.json), a model "
            "already in the Hugging Face cache (`huggingface-cli download NAME`), or 'byte' for the "
            "built-in byte-level tokenizer."
        ) from None


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer for the token cache: its name, size, specials and a
    hash of its full definition (vocabulary, merges, normalizer), so a retrained or
    edited tokenizer with the same name never reuses stale token ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # a slow (Python) tokenizer: its vocabulary is the best identity we have
        definition = repr(sorted(tokenizer.get_vocab().items()))
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "definition_sha256": hashlib.sha256(definition.encode("utf-8")).hexdigest(),
    }
