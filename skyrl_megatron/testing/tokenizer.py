"""A tiny, fully offline tokenizer for tests and demos.

Real tokenizers need hub downloads and have vocabularies far larger than a tiny test model wants.
This one is built in memory with the `tokenizers` library: one token per character of printable
ASCII (plus newline and tab), a handful of special tokens, and filler tokens up to an exact vocab
size. Character-level tokens make encode/decode an exact round trip, which lets tests on arithmetic
prompts such as ``"12+7=19"`` compare text without worrying about merges or whitespace cleanup.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)

# Every character the tokenizer knows; anything else encodes to UNK_TOKEN.
CHARACTERS = tuple(chr(code) for code in range(32, 127)) + ("\n", "\t")

# Each turn is `<|role|>content<|eos|>`, so a model learns to end its answer with EOS, which is
# exactly the token generation stops on. The generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)
FILLER_PATTERN = r"<\|unused_\d+\|>"


def _build_vocab(vocab_size: int) -> dict[str, int]:
    """Special tokens first (so pad/bos/eos get the small ids 0/1/2), then characters, then filler."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    tokens += [f"<|unused_{i}|>" for i in range(vocab_size - len(tokens))]  # FILLER_PATTERN
    return {token: index for index, token in enumerate(tokens)}


def _build_backend(vocab_size: int) -> Tokenizer:
    """A WordLevel model over single characters: splitting every character off keeps spaces intact."""
    vocab = _build_vocab(vocab_size)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Filler tokens decode to nothing, so text a model samples holds only real characters. They stay
    # plain vocabulary entries, not added tokens: a published-size vocabulary (151,936) as added tokens
    # took 32 s to load and 37 s to pickle (the host pickles the tokenizer into each dataset worker).
    # Fuse joins tokens with no separator; the WordLevel default would insert spaces between them.
    backend.decoder = decoders.Sequence([decoders.Replace(Regex(FILLER_PATTERN), ""), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return backend


def make_tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer with exactly `vocab_size` tokens and a chat template.

    `vocab_size` must match the tiny model's embedding size, so padding the vocabulary with unused
    tokens (rather than letting it be whatever the character set yields) keeps the two consistent.
    """
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_build_backend(vocab_size),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        # Cleanup would rewrite " ." into "." and break the exact round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 256) -> Path:
    """Write the tiny tokenizer to `out_dir` so `AutoTokenizer.from_pretrained(out_dir)` loads it."""
    out_path = Path(out_dir)
    make_tiny_tokenizer(vocab_size).save_pretrained(out_path)
    return out_path
