"""`qwen38 prepare draft-vocab`: the reduced output vocabulary of the MTP draft head.

A speculator whose head covers a subset of the vocabulary is cheaper per draft step (the
3090 seed's MTP head: 40,960 of 248,320 tokens) but can only propose tokens in the
subset: a target token outside it is a rejected draft. The subset is either a pinned id
list, or the most frequent tokens of a corpus - ideally the model's own outputs (the seed:
97.5 % coverage from 5.4M output tokens, 92 % from web text) - counted with the model's
own tokenizer. Coverage (the share of held-out tokens inside the subset) is reported.

Output directory (atomic, with its manifest; identity: a `DerivedIdentity` ``draft-vocab``
whose input is the model directory - for its tokenizer - and whose ``params`` hold the size
and the sha256 of the id list or corpus files and held-out files):

- ``draft_vocab.json``: ``token_ids`` (ascending target ids), sizes, source, coverage;
- ``draft_vocab.safetensors``: ``d2t`` int64 [N] with ``target_id = draft_index +
  d2t[draft_index]`` and ``t2d`` bool [V] marking the target ids in the subset - the
  EAGLE-3 convention vLLM 0.28.0 reads for drafters with ``draft_vocab_size`` (the
  ``d2t`` -> ``draft_id_to_target_id`` mapping in ``llama_eagle3.py`` /
  ``qwen3_dflash.py``; ``t2d`` is skipped there). Stock ``Qwen3_5MTP`` has no draft vocabulary:
  the MTP draft-vocabulary patch reads these two files from the model directory
  (``qwen38 prepare requantize --draft-vocab DIR`` puts them there). See docs/prepare.md.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.checkpoint import CONFIG_NAME, read_json, text_config
from core.errors import PrepareError
from core.identity import DerivedIdentity
from core.manifest import is_current, sha256_file
from core.safetensors_stream import ShardWriter, TensorSpec
from prepare.derived import build_lock, derived_directory, open_input, refuse_overlap

TRANSFORM = "draft-vocab"
TRANSFORM_VERSION = "1"  # bump whenever the output bytes would change for the same input and params
FORMAT_VERSION = 1  # of draft_vocab.json
DEFAULT_SIZE = 40_960
VOCAB_JSON = "draft_vocab.json"
VOCAB_TENSORS = "draft_vocab.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
HELDOUT_EVERY = 10  # without --heldout: every 10th corpus record is held out
_BATCH = 512


@dataclass
class DraftVocabResult:
    out: Path
    up_to_date: bool
    size: int = 0
    target_vocab_size: int = 0
    coverage: dict[str, Any] = field(default_factory=dict)


def draft_vocab_files(directory: Path) -> list[Path]:
    """The files of a draft-vocab output that a model directory carries."""
    files = [directory / VOCAB_JSON, directory / VOCAB_TENSORS]
    missing = [p for p in files if not p.is_file()]
    if missing:
        raise PrepareError(f"{missing[0]}: missing; build it with `qwen38 prepare draft-vocab`")
    return files


# ----------------------------------------------------------------------------- pure core


def select_ids(counts: Sequence[int], size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` ids to keep: ``always`` first, then by count (ties: lower id), then lowest ids."""
    vocab = len(counts)
    if not 0 < size <= vocab:
        raise PrepareError(f"--size {size}: must be between 1 and the model's vocabulary size {vocab}")
    chosen = sorted({i for i in always if 0 <= i < vocab})[:size]
    taken = set(chosen)
    by_count = sorted((i for i in range(vocab) if counts[i] > 0 and i not in taken), key=lambda i: (-counts[i], i))
    for i in by_count[: size - len(chosen)]:
        chosen.append(i)
        taken.add(i)
    for i in range(vocab):  # a corpus too small to name `size` tokens: fill with the lowest ids
        if len(chosen) >= size:
            break
        if i not in taken:
            chosen.append(i)
    return sorted(chosen)


def mapping_tensors(ids: Sequence[int], vocab_size: int) -> tuple[bytes, bytes]:
    """``d2t`` (int64 offsets) and ``t2d`` (bool mask) as little-endian bytes."""
    d2t = struct.pack(f"<{len(ids)}q", *(target - index for index, target in enumerate(ids)))
    mask = bytearray(vocab_size)
    for target in ids:
        mask[target] = 1
    return d2t, bytes(mask)


def coverage(counts: Sequence[int], ids: Iterable[int]) -> tuple[float, int]:
    total = sum(counts)
    inside = sum(counts[i] for i in ids)
    return (inside / total if total else 0.0), total


# ----------------------------------------------------------------------------- corpus


def iter_records(path: Path) -> Iterator[str]:
    """Texts of a corpus file: a JSON Lines file gives each line's ``text`` (or the line's
    JSON string); any other file gives its paragraphs, each with the blank lines after it
    (tokens span line ends - ``"\n    "`` is one token - so lines would miscount them)."""
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise PrepareError(f"{path}: cannot read the corpus ({exc.strerror})") from exc
    with handle:
        if path.suffix == ".jsonl":
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PrepareError(f"{path}:{number}: not JSON ({exc.msg})") from exc
                text = record.get("text") if isinstance(record, dict) else record
                if not isinstance(text, str):
                    raise PrepareError(f'{path}:{number}: expected a JSON string or an object with a "text" string')
                yield text
        else:
            paragraph: list[str] = []
            for line in handle:
                if line.strip() and paragraph and not paragraph[-1].strip():
                    yield "".join(paragraph)
                    paragraph = []
                paragraph.append(line)
            if paragraph:
                yield "".join(paragraph)


class TokenCounter:
    """Counts token ids with the model's own tokenizer (no special tokens added)."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise PrepareError(
                f"{model_dir}: cannot load its tokenizer ({exc}); the model directory needs tokenizer files"
            ) from exc
        self.vocab_size = vocab_size
        if len(self.tokenizer) > vocab_size:
            raise PrepareError(
                f"{model_dir}: tokenizer has {len(self.tokenizer)} tokens, more than config.json vocab_size {vocab_size}"
            )

    def special_ids(self) -> list[int]:
        return sorted({int(i) for i in self.tokenizer.all_special_ids})

    def count(self, texts: Iterable[str]) -> list[int]:
        import numpy as np

        counts = np.zeros(self.vocab_size, dtype=np.int64)
        batch: list[str] = []

        def flush() -> None:
            ids = self.tokenizer(batch, add_special_tokens=False)["input_ids"]
            flat = np.fromiter((t for seq in ids for t in seq), dtype=np.int64)
            if flat.size:
                counts[:] += np.bincount(flat, minlength=self.vocab_size)[: self.vocab_size]
            batch.clear()

        for text in texts:
            batch.append(text)
            if len(batch) >= _BATCH:
                flush()
        if batch:
            flush()
        return counts.tolist()


def split_records(paths: Sequence[Path], every: int) -> tuple[Iterator[str], list[str]]:
    """Corpus records minus every ``every``-th one, and those held out (deterministic)."""
    heldout: list[str] = []

    def kept() -> Iterator[str]:
        index = 0
        for path in paths:
            for text in iter_records(path):
                index += 1
                if every and index % every == 0:
                    heldout.append(text)
                else:
                    yield text

    return kept(), heldout


# ----------------------------------------------------------------------------- step


def load_pinned_ids(path: Path, vocab_size: int) -> list[int]:
    data = read_json(path)
    ids = data.get("ids", data.get("token_ids")) if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise PrepareError(f'{path}: expected a JSON list of token ids (or {{"ids": [...]}})')
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise PrepareError(f"{path}: id {bad[0]} outside the model's vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise PrepareError(f"{path}: {len(ids) - len(set(ids))} duplicate ids; a draft vocabulary lists each id once")
    return sorted(ids)


def _file_identity(paths: Sequence[Path]) -> list[dict[str, Any]]:
    return [{"name": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]


def _target_vocab_size(model_dir: Path) -> int:
    try:
        config = read_json(model_dir / CONFIG_NAME)
    except FileNotFoundError:
        raise PrepareError(f"{model_dir / CONFIG_NAME}: missing; --model must be the target model directory") from None
    size = config.get("vocab_size") or text_config(config).get("vocab_size")
    if not isinstance(size, int) or size <= 0:
        raise PrepareError(f"{model_dir / CONFIG_NAME}: no vocab_size")
    return size


def build_draft_vocab(
    model_dir: Path | str,
    out: Path | str,
    *,
    ids_file: Path | str | None = None,
    corpus: Sequence[Path | str] = (),
    heldout: Sequence[Path | str] = (),
    size: int | None = None,
) -> DraftVocabResult:
    """Write a draft vocabulary to ``out`` from a pinned id list or a corpus (idempotent).

    With a corpus, ``size`` (default 40,960) ids are kept; held-out coverage is measured on
    ``heldout`` files, or on every 10th corpus record when none are given.
    """
    model_dir, out = Path(model_dir), Path(out)
    corpus_paths = [Path(p) for p in corpus]
    heldout_paths = [Path(p) for p in heldout]
    if (ids_file is None) == (not corpus_paths):
        raise PrepareError("draft-vocab: give exactly one of --ids FILE or --corpus FILE...")
    refuse_overlap([model_dir], out)
    vocab_size = _target_vocab_size(model_dir)
    # The tokenizer is what is read from the model: a model directory without a manifest
    # (a user's own checkpoint) is identified by its tokenizer files and config alone.
    tokenizer_files = [n for n in (CONFIG_NAME, *TOKENIZER_FILES) if (model_dir / n).is_file()]
    model = open_input(model_dir, "tokenizer", allow_unmanifested=True, only=tokenizer_files)
    source: dict[str, Any]
    if ids_file is not None:
        source = {"kind": "ids", "files": _file_identity([Path(ids_file)])}
    else:
        source = {
            "kind": "corpus",
            "files": _file_identity(corpus_paths),
            "heldout_every": 0 if heldout_paths else HELDOUT_EVERY,
        }
    if ids_file is None and size is None:
        size = DEFAULT_SIZE
    identity = DerivedIdentity(
        transform=TRANSFORM,
        transform_version=TRANSFORM_VERSION,
        params={
            "size": size if ids_file is None else None,
            "target_vocab_size": vocab_size,
            "source": source,
            "heldout": _file_identity(heldout_paths),
        },
        inputs=(model.ref,),
    )

    with build_lock(out):
        if is_current(out, identity):
            saved = read_json(out / VOCAB_JSON)
            return DraftVocabResult(out, True, saved["draft_vocab_size"], vocab_size, saved.get("coverage", {}))
        counter = TokenCounter(model_dir, vocab_size) if (corpus_paths or heldout_paths) else None
        report: dict[str, Any] = {}
        if ids_file is not None:
            ids = load_pinned_ids(Path(ids_file), vocab_size)
            if size is not None and size != len(ids):
                raise PrepareError(f"{ids_file}: {len(ids)} ids, --size asks for {size}")
        else:
            assert counter is not None and size is not None
            kept, held = split_records(corpus_paths, 0 if heldout_paths else HELDOUT_EVERY)
            counts = counter.count(kept)
            ids = select_ids(counts, size, counter.special_ids())
            report["corpus"], report["corpus_tokens"] = coverage(counts, ids)
            if not heldout_paths:
                report["heldout"], report["heldout_tokens"] = coverage(counter.count(held), ids)
        if heldout_paths:
            assert counter is not None
            records = (text for path in heldout_paths for text in iter_records(path))
            report["heldout"], report["heldout_tokens"] = coverage(counter.count(records), ids)

        d2t, t2d = mapping_tensors(ids, vocab_size)
        document = {
            "format": "qwen38-draft-vocab",
            "version": FORMAT_VERSION,
            "target_vocab_size": vocab_size,
            "draft_vocab_size": len(ids),
            "convention": "target_id = draft_index + d2t[draft_index]; t2d[target_id] is true for drafted ids",
            "coverage": report,
            "token_ids": ids,
        }
        with derived_directory(out, identity) as stage:
            (stage.path / VOCAB_JSON).write_text(json.dumps(document, separators=(",", ":")) + "\n", encoding="utf-8")
            writer = ShardWriter(
                stage.path / VOCAB_TENSORS,
                [TensorSpec("d2t", "I64", (len(ids),)), TensorSpec("t2d", "BOOL", (vocab_size,))],
                {"format": "pt"},
            )
            writer.write("d2t", d2t)
            writer.write("t2d", t2d)
            writer.finish()
    return DraftVocabResult(out, False, len(ids), vocab_size, report)


__all__ = ["build_draft_vocab", "draft_vocab_files", "select_ids", "mapping_tensors", "coverage", "DraftVocabResult"]
