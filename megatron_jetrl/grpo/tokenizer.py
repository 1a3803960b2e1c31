"""Tokenizers behind one small interface: `encode(text) -> ids` (no BOS/EOS added), `decode(ids) -> text`
(control/special tokens such as EOS and padding decode to nothing), `eos_id`, `pad_id`, `vocab_size`.

`SentencePieceTokenizer` is the tiny default's tokenizer, trained here on the synthetic corpus;
`HFTokenizer` wraps a real model's tokenizer directory through transformers.

The tiny SentencePiece model (`SentencePieceTokenizer.train`):
- BPE. With `split_digits=True` a digit never merges, and the arithmetic corpus supports almost no other
  merges, so BPE and unigram end with the same pieces; BPE is chosen because its training is a greedy
  count of merges (no EM, no pruning by loss), so pieces that never occur in the corpus cannot change what
  it learns. The exact-size construction below relies on that.
- Ids: `<unk>` 0, `<s>` 1, `</s>` (EOS) 2, `<pad>` 3 (BOS 1 / EOS 2 as in the tiny model config).
- Text is kept as is: identity normalization, no dummy-prefix `▁`, no whitespace collapsing, so
  `decode(encode(s)) == s` for ASCII text, and `encode(question) + encode(answer) == encode(question +
  answer)` on the arithmetic corpus (nothing merges across `=`): a prompt and its completion tokenize the
  same apart as together.
- Exact `vocab_size`, no byte fallback. The arithmetic corpus supports only ~17 pieces, while the model's
  embedding is sized `vocab_size`; `hard_vocab_limit=False` would silently return fewer pieces. So the
  vocabulary is filled deterministically: printable ASCII (plus `▁` for space, tab and newline) that the
  corpus lacks becomes single-character user symbols (any ASCII prompt encodes without `<unk>`), then a
  first pass with a soft limit counts how many pieces the corpus supports, and the rest are reserved
  symbols `<reserved_0>`, `<reserved_1>`, ... (never produced from ordinary text), trained with the hard
  limit so the size is exactly `vocab_size`. Training is single-threaded (`num_threads=1`) and gives the
  same model bytes for the same lines and size (tested).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from megatron_jetrl.models.shards import atomic_write_bytes

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_SPACE = "\u2581"  # sentencepiece's escaped space
_COVERED = [chr(c) for c in range(33, 127)] + [_SPACE, "\t", "\n"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the GRPO loop needs from a tokenizer."""

    eos_id: int
    """The id that ends a completion (both implementations also expose `eos_ids`, every id that does)."""
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS or EOS."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens (EOS, padding) decode to nothing."""


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _train_bytes(lines: Sequence[str], vocab_size: int, user_symbols: Sequence[str], hard_limit: bool) -> bytes:
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        split_digits=True,
        byte_fallback=False,
        hard_vocab_limit=hard_limit,
        character_coverage=1.0,
        num_threads=1,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        max_sentence_length=max([4192] + [len(s.encode()) + 1 for s in lines]),
        user_defined_symbols=list(user_symbols),
        minloglevel=2,
    )
    return out.getvalue()


def _piece_count(model: bytes) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=model).get_piece_size()


def train_sentencepiece_bytes(lines: Iterable[str], vocab_size: int) -> bytes:
    """Serialized BPE model of exactly `vocab_size` pieces for `lines` (module docstring)."""
    lines = [str(s) for s in lines]
    if not lines or not any(lines):
        raise ValueError("no text to train a tokenizer on: pass the corpus lines (e.g. ArithmeticTask().sft_corpus(...))")
    if any("\n" in s or "\r" in s for s in lines):
        raise ValueError("tokenizer training lines must be single lines: split text at newlines first")
    present = set("".join(lines).replace(" ", _SPACE))
    ascii_symbols = [c for c in _COVERED if c not in present]
    minimum = 4 + len(present) + len(ascii_symbols)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for this corpus: 4 special tokens + {len(present)} "
            f"corpus characters + {len(ascii_symbols)} ASCII symbols need at least {minimum}"
        )
    natural = _piece_count(_train_bytes(lines, vocab_size, ascii_symbols, hard_limit=False))
    reserved = [f"<reserved_{i}>" for i in range(vocab_size - natural)]
    model = _train_bytes(lines, vocab_size, ascii_symbols + reserved, hard_limit=True)
    if _piece_count(model) != vocab_size:  # sentencepiece enforces this with hard_vocab_limit; say so if not
        raise RuntimeError(f"sentencepiece returned {_piece_count(model)} pieces, asked for {vocab_size}")
    return model


class SentencePieceTokenizer:
    """A SentencePiece model file behind the `Tokenizer` interface."""

    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        self.path = Path(model_path)
        if not self.path.is_file():
            raise ValueError(
                f"no sentencepiece model at {self.path}: train one with SentencePieceTokenizer.train or ensure_sentencepiece"
            )
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id, self.pad_id, self.bos_id = self.sp.eos_id(), self.sp.pad_id(), self.sp.bos_id()
        self.eos_ids = (self.eos_id,)
        if self.eos_id < 0 or self.pad_id < 0:
            raise ValueError(
                f"{self.path} defines no EOS or no padding piece (eos {self.eos_id}, pad {self.pad_id}); "
                "train it with SentencePieceTokenizer.train"
            )

    @classmethod
    def train(cls, lines: Iterable[str], out_path: str | Path, vocab_size: int = 256) -> SentencePieceTokenizer:
        """Train the tiny BPE model on `lines` (module docstring), write it atomically to `out_path`, load it."""
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out_path, train_sentencepiece_bytes(lines, vocab_size))
        return cls(out_path)

    def hf_config(self) -> dict:
        """tokenizer_config.json that makes the directory of this model file a Hugging Face tokenizer: transformers'
        `LlamaTokenizer` reads the same file and encodes like `encode` (no BOS/EOS, no dummy prefix; tested)."""
        sp = self.sp
        return {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            "add_prefix_space": False,
            "bos_token": sp.id_to_piece(self.bos_id),
            "eos_token": sp.id_to_piece(self.eos_id),
            "unk_token": sp.id_to_piece(sp.unk_id()),
            "pad_token": sp.id_to_piece(self.pad_id),
        }

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(_check_ids(ids, self.vocab_size))

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of one id (for debugging)."""
        return self.sp.id_to_piece(_check_ids([token_id], self.vocab_size)[0])


def ensure_sentencepiece(path: str | Path, lines: Iterable[str], vocab_size: int = 256) -> SentencePieceTokenizer:
    """Load the model at `path`; train it on `lines` first only if the file is missing.

    An existing model of another size is refused: the model's embedding is sized from `vocab_size`.
    """
    path = Path(path)
    if not path.exists():
        return SentencePieceTokenizer.train(lines, path, vocab_size)
    tok = SentencePieceTokenizer(path)
    if tok.vocab_size != vocab_size:
        raise ValueError(
            f"{path} holds a {tok.vocab_size}-piece tokenizer, asked for {vocab_size}: "
            f"delete it to retrain, or ask for vocab_size={tok.vocab_size}"
        )
    return tok


def _config_eos_ids(model_dir: Path) -> list[int]:
    """EOS ids from config.json, then generation_config.json (each may hold an int or a list), in order."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = model_dir / name
        if not f.is_file():
            continue
        value = json.loads(f.read_text()).get("eos_token_id")
        for i in [] if value is None else value if isinstance(value, list) else [value]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


class HFTokenizer:
    """A Hugging Face tokenizer directory (transformers `AutoTokenizer`, local files only).

    `eos_id` is the first `eos_token_id` of `config.json` (else `generation_config.json`, else the
    tokenizer's own EOS); `eos_ids` lists every EOS id the two configs name (instruct models end turns
    with several; give them all to the rollout engine as stop ids). `pad_id` is the tokenizer's padding
    token, or EOS if it has none. `vocab_size` is `len(tokenizer)` (added tokens included), which can be
    smaller than the model's padded embedding.
    """

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(model_dir)
        if not self.path.is_dir():
            raise ValueError(f"{self.path} is not a directory: give a local model/tokenizer directory")
        self.tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.eos_ids = tuple(_config_eos_ids(self.path)) or (
            (self.tok.eos_token_id,) if self.tok.eos_token_id is not None else ()
        )
        if not self.eos_ids:
            raise ValueError(
                f"{self.path}: no eos_token_id in config.json / generation_config.json and the "
                "tokenizer defines no EOS token; add eos_token_id to config.json"
            )
        self.eos_id = self.eos_ids[0]
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens and ids past the tokenizer (the model's padded embedding rows, e.g.
        Qwen2.5-7B has 152064 rows for 151665 tokens, which a sampler can still pick) decode to nothing."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"token id {min(ids)} is negative")
        return self.tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)
