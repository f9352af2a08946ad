"""The generated models' tokenizer: a byte-level BPE trained here on a seeded corpus.

Every model `qwen38 generate` writes, tiny to full size, carries it (a full-size target's
vocabulary is filled up to 248,320 ids with placeholder tokens): special tokens first (ids
0-9, so that a model knows them without the tokenizer: `prepare.synthetic.SPECIAL_IDS`), a
ChatML chat template with tools and an ``enable_thinking`` switch. Two runs with one seed
give the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|mask|>",
]
TOKENIZER_VOCAB = 1000
CHAT_TEMPLATE = Path(__file__).with_name("tiny_chat_template.jinja")
# A vision model's tokenizer: these take the last ids of the filled vocabulary (as the real
# checkpoint's sit near the top of its 248,320), and its template places images.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_CHAT_TEMPLATE = Path(__file__).with_name("tiny_vl_chat_template.jinja")


# ---- tokenizer ---------------------------------------------------------------------------

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or have an they which "
    "one you were her all she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three model token cache server request context memory card "
    "speed layer weight adapter draft verify prefix queue slot stream answer reason tool call file"
).split()
_CODE = (
    "def return import from class self None True False if else elif for while in not and or "
    "print len range dict list str int float json async await yield lambda with as try except "
    "raise assert pass break continue {} [] () = == != <= >= + - * / % : , . -> # ' \""
).split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """A seeded mix of prose, code and JSON: enough to train a byte-level BPE."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 5
        if kind < 3:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
            out.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
        elif kind == 3:
            name = "_".join(rng.sample(_WORDS, 2))
            body = " ".join(rng.choice(_CODE) for _ in range(rng.randint(4, 12)))
            out.append(f"def {name}(x, y=2):\n    {body}\n    return x + {rng.randint(0, 999)}")
        else:
            key, value = rng.sample(_WORDS, 2)
            out.append(json.dumps({"name": key, "arguments": {value: rng.randint(0, 99), "unit": key}}))
    return out


def build_tokenizer(
    seed: int, vocab: int = TOKENIZER_VOCAB, *, fill_to: int | None = None, corpus: tuple[str, ...] | None = None,
    vision: bool = False,
):
    """Train the byte-level BPE (``vocab`` tokens) and wrap it as a transformers fast tokenizer.

    ``fill_to``: placeholder tokens ``<tN>`` fill the vocabulary up to that many ids (a random
    model of the real vocabulary emits any id, and every id must decode). Encoding never
    produces them (no merge makes them); they decode to plain ASCII, which the byte-level
    alphabet maps to itself. ``corpus``: lines to train on instead of the seeded mix.
    ``vision``: `VISION_TOKENS` replace the last placeholders (``fill_to`` needed) and the
    template is the vision one; without it the files are what they always were.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else _corpus(seed), trainer=trainer)
    if fill_to is not None and fill_to > tok.get_vocab_size():
        data = json.loads(tok.to_str())
        taken = tok.get_vocab_size()
        data["model"]["vocab"].update({f"<t{i}>": i for i in range(taken, fill_to)})
        if vision:
            _name_last_ids(data, VISION_TOKENS, fill_to)
        tok = Tokenizer.from_str(json.dumps(data))
    elif vision:
        raise ValueError("a vision tokenizer names the last placeholder ids: pass fill_to above the BPE vocabulary")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:] + (VISION_TOKENS if vision else []),
    )
    fast.chat_template = (VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE).read_text(encoding="utf-8")
    return fast


def _name_last_ids(data: dict, tokens: list[str], fill_to: int) -> None:
    """``tokens`` take the ids fill_to - len(tokens) ... fill_to - 1 (placeholders before), as
    special added tokens: never split, never produced by a merge."""
    vocab = data["model"]["vocab"]
    for offset, token in enumerate(tokens):
        token_id = fill_to - len(tokens) + offset
        del vocab[f"<t{token_id}>"]
        vocab[token] = token_id
        data["added_tokens"].append({"id": token_id, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})


def drop_nondeterministic(directory: Path) -> None:
    """Keep only what vLLM reads; transformers adds nothing random, but be explicit."""
    for extra in ("special_tokens_map.json",):
        path = directory / extra
        if path.exists():
            path.unlink()
