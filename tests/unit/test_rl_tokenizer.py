"""The tiny SentencePiece tokenizer (exact size, deterministic, digits split) and the HF wrapper's interface."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_jetrl.grpo.data import ArithmeticTask
from megatron_jetrl.grpo.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    ensure_sentencepiece,
    train_sentencepiece_bytes,
)

CORPUS = ArithmeticTask().sft_corpus(4000, seed=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return SentencePieceTokenizer.train(CORPUS, tmp_path_factory.mktemp("spm") / "tokenizer.model", vocab_size=256)


def test_training_twice_gives_identical_bytes(tmp_path):
    """sentencepiece with num_threads=1 is byte-deterministic here, so the model files themselves are compared."""
    a = SentencePieceTokenizer.train(CORPUS, tmp_path / "a.model", 256)
    b = SentencePieceTokenizer.train(CORPUS, tmp_path / "b.model", 256)
    assert a.path.read_bytes() == b.path.read_bytes() == train_sentencepiece_bytes(CORPUS, 256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "b.model"]  # no temp file left behind


@pytest.mark.parametrize("vocab_size", [128, 256, 384])
def test_vocab_size_is_exact(tmp_path, vocab_size):
    t = SentencePieceTokenizer.train(CORPUS, tmp_path / "t.model", vocab_size)
    assert t.vocab_size == vocab_size
    assert t.piece(vocab_size - 1) != t.piece(vocab_size - 2)


def test_richer_corpus_fills_the_vocabulary_with_merges(tmp_path):
    words = [f"the {w} sat on mat number {i}" for i, w in enumerate(["cat", "dog", "bird", "frog"] * 50)]
    t = SentencePieceTokenizer.train(words, tmp_path / "w.model", 160)
    assert t.vocab_size == 160
    assert len(t.encode("the cat sat")) < len("the cat sat")  # BPE merged pieces


def test_special_ids_and_interface(tok):
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (EOS_ID, PAD_ID, BOS_ID) == (2, 3, 1)
    assert tok.eos_ids == (2,)
    assert [tok.piece(i) for i in (UNK_ID, BOS_ID, EOS_ID, PAD_ID)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("37+45=82")
    assert len(ids) == 8 and BOS_ID not in ids and EOS_ID not in ids  # nothing added
    assert tok.decode(ids + [EOS_ID, PAD_ID, PAD_ID]) == "37+45=82"  # control tokens decode to nothing


def test_every_digit_is_one_token(tok):
    ids = tok.encode("1234567890")
    assert [tok.piece(i) for i in ids] == list("1234567890")
    assert len(set(tok.encode("0123456789+-="))) == 13


def test_prompt_and_answer_tokenize_the_same_apart_as_together(tok):
    for p in ArithmeticTask().problems(300, seed=5):
        assert tok.encode(p.question) + tok.encode(p.answer) == tok.encode(p.question + p.answer)


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126) | st.sampled_from("\t\n"), max_size=40))
def test_ascii_round_trips_without_unk(tok, text):
    ids = tok.encode(text)
    assert UNK_ID not in ids
    assert tok.decode(ids) == text


def test_decode_rejects_foreign_ids(tok):
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
        tok.decode([5, 256])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])


def test_ensure_trains_once_then_loads(tmp_path):
    path = tmp_path / "run" / "tokenizer.model"
    first = ensure_sentencepiece(path, CORPUS, 256)
    data = path.read_bytes()
    again = ensure_sentencepiece(path, [], 256)  # no corpus: it must not train
    assert again.vocab_size == 256 and path.read_bytes() == data == first.path.read_bytes()
    with pytest.raises(ValueError, match="holds a 256-piece tokenizer, asked for 300.*delete it"):
        ensure_sentencepiece(path, CORPUS, 300)


def test_training_input_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 64 is too small.*13 corpus characters.*84 ASCII symbols need at least 101"):
        train_sentencepiece_bytes(CORPUS, 64)
    with pytest.raises(ValueError, match="no text to train"):
        train_sentencepiece_bytes([], 256)
    with pytest.raises(ValueError, match="single lines"):
        train_sentencepiece_bytes(["1+1=2\n2+2=4"], 256)
    with pytest.raises(ValueError, match="no sentencepiece model"):
        SentencePieceTokenizer(tmp_path / "none.model")


def hf_tokenizer_dir(directory, config_eos, generation_eos=None):
    """A tiny character-level HF tokenizer written by transformers itself (no hub access needed)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, **{c: i + 4 for i, c in enumerate("0123456789+-= ")}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>", additional_special_tokens=["<|im_end|>"]
    )
    fast.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory


def test_hf_tokenizer_reads_eos_from_config(tmp_path):
    hf = HFTokenizer(hf_tokenizer_dir(tmp_path, config_eos=3, generation_eos=[3, 2]))
    assert isinstance(hf, Tokenizer)
    assert (hf.eos_id, hf.eos_ids, hf.pad_id, hf.vocab_size) == (3, (3, 2), 3, 18)  # no pad token -> EOS
    ids = hf.encode("37+45=82")
    assert ids == [7, 11, 14, 8, 9, 16, 12, 6]  # no BOS/EOS added
    assert hf.decode(ids + [3, 2]) == "37+45=82"
    assert hf.decode([7, 18, 500, 11]) == "37"  # padded embedding rows past the tokenizer: nothing
    with pytest.raises(ValueError, match="token id -1 is negative"):
        hf.decode([7, -1])


def test_hf_tokenizer_falls_back_to_the_tokenizer_eos(tmp_path):
    hf = HFTokenizer(hf_tokenizer_dir(tmp_path, config_eos=None))
    assert hf.eos_ids == (2,) and hf.eos_id == 2
    with pytest.raises(ValueError, match="not a directory"):
        HFTokenizer(tmp_path / "missing")


def test_the_embedded_tokenizer_is_an_hf_tokenizer_directory(tok, tmp_path):
    """What the trainer puts next to tokenizer.model (and so into export/): transformers loads it and encodes the same."""
    import json
    import shutil

    from transformers import AutoTokenizer

    shutil.copy(tok.path, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok.hf_config()))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in CORPUS[:50] + ["Hello world  x\tz\n1+2=3", " leading space"]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text), text
    assert (hf.eos_token_id, hf.pad_token_id, len(hf)) == (tok.eos_id, tok.pad_id, tok.vocab_size)
