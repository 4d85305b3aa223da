"""The tokenizer and the token map: trained at first use, cached afterwards.

The tokenizer is a Hugging Face ``tokenizers`` byte-level BPE trained on the
text shipped in ``fabric/serving/data`` (English, Chinese, Japanese, Korean,
emoji, code). Its vocabulary is small on purpose, so rare CJK characters and
emoji stay split across two or three tokens and the detokenizer must hold
incomplete UTF-8 bytes.

The toy decoder's ids are mapped into the tokenizer's vocabulary by a
*corpus walk* (:class:`CorpusWalk`): each sequence has a cursor in the
tokenized training text; every step emits the token under the cursor and
advances it, and when the toy decoder's id says so (one id in
``JUMP_EVERY``) and the cursor sits at the start of a line, the cursor jumps
to a line start chosen by that id. The stream is therefore real text, made of
real tokens, with characters split across tokens exactly as the tokenizer
splits them, and valid UTF-8 whatever the toy decoder does.

Training takes well under a second; the result (``tokenizer.json`` and the
tokenized text) is cached under ``$SEMFAB_CACHE_DIR``, else
``$XDG_CACHE_HOME/semfab``, else ``~/.cache/semfab``, in a folder named by a
hash of the text and the training settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATA_DIR = Path(__file__).resolve().parent / "data"
#: Vocabulary size asked of the trainer (the text may give fewer merges).
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|endoftext|>",)
#: The corpus walk may jump when ``toy_id % JUMP_EVERY == 0``.
JUMP_EVERY = 4
_FORMAT = 2  # bump when the cached files change meaning


def corpus_files(data_dir: Path = DATA_DIR) -> list[Path]:
    """The training text files, in name order (README files excluded)."""
    return sorted(p for p in data_dir.glob("*.txt") if not p.name.upper().startswith("README"))


def corpus_text(data_dir: Path = DATA_DIR) -> str:
    """All training text, files joined with blank lines."""
    files = corpus_files(data_dir)
    if not files:
        raise FileNotFoundError(f"no training text (*.txt) in {data_dir}")
    return "\n\n".join(p.read_text(encoding="utf-8").strip("\n") for p in files) + "\n"


def cache_root() -> Path:
    """Where trained tokenizers are kept."""
    env = os.environ.get("SEMFAB_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "semfab"


def _fingerprint(text: str) -> str:
    import tokenizers

    h = hashlib.sha256()
    h.update(text.encode("utf-8"))
    h.update(json.dumps([_FORMAT, VOCAB_SIZE, SPECIAL_TOKENS, tokenizers.__version__]).encode())
    return h.hexdigest()[:16]


def train_tokenizer(text: str) -> Any:
    """Train the byte-level BPE on ``text`` (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token
        special_tokens=list(SPECIAL_TOKENS),
    )
    tok.train_from_iterator([text], trainer)
    return tok


def _char_starts(data: bytes) -> np.ndarray:
    """Boolean per byte: True where a UTF-8 character starts (not a continuation byte)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return (arr & 0xC0) != 0x80


def build(text: str, out_dir: Path) -> None:
    """Train, tokenize the text, and write the cache files into ``out_dir``."""
    tok = train_tokenizer(text)
    enc = tok.encode(text)
    ids = np.asarray(enc.ids, dtype=np.int32)
    if tok.decode(enc.ids) != text:
        raise RuntimeError("trained tokenizer does not round-trip its own training text")
    data = text.encode("utf-8")
    # byte offset where each token starts, from the tokens' own byte lengths
    from fabric.serving.detok import byte_table

    table = byte_table(tok)
    lengths = np.fromiter((len(table[i]) for i in ids), dtype=np.int64, count=ids.size)
    starts_b = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if int(lengths.sum()) != len(data):
        raise RuntimeError("token byte lengths do not add up to the training text")
    boundary = _char_starts(data + b"\n")  # a sentinel so the end counts as a boundary
    safe = boundary[starts_b]
    prev_newline = np.zeros(ids.size, dtype=bool)
    prev_newline[0] = True
    prev_newline[1:] = np.frombuffer(data, np.uint8)[starts_b[1:] - 1] == ord("\n")
    jump_ok = safe & prev_newline  # whole lines: readable text, whole characters
    line_starts = np.flatnonzero(jump_ok).astype(np.int64)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    np.save(out_dir / "corpus_ids.npy", ids)
    np.save(out_dir / "jump_ok.npy", jump_ok)
    np.save(out_dir / "line_starts.npy", line_starts)
    (out_dir / "info.json").write_text(json.dumps({
        "vocab_size": tok.get_vocab_size(), "corpus_tokens": int(ids.size),
        "corpus_bytes": len(data), "line_starts": int(line_starts.size),
    }))


def ensure_assets(cache_dir: str | Path | None = None) -> Path:
    """The folder holding a trained tokenizer for the shipped text (trains it if needed).

    Safe when several processes call it at once: each trains into a private
    folder and renames it into place; the loser of the race uses the winner's.
    """
    text = corpus_text()
    root = Path(cache_dir) if cache_dir else cache_root()
    final = root / f"tokenizer-{_fingerprint(text)}"
    if (final / "info.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".train-", dir=root))
    try:
        build(text, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "info.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def local_assets(assets_dir: str | Path) -> Path:
    """``assets_dir`` when it holds the tokenizer on this machine, else this
    machine's own copy (trained here if needed): a task placed on another host
    than the process that chose the folder. The same shipped text and settings
    give the same tokenizer everywhere (its folder is named by the text's hash)."""
    if assets_dir and (Path(assets_dir) / "info.json").is_file():
        return Path(assets_dir)
    return ensure_assets()


def load_tokenizer(assets_dir: str | Path) -> Any:
    """The cached ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(assets_dir) / "tokenizer.json"))


def model_vocab(assets_dir: str | Path, size: int) -> np.ndarray:
    """The tokenizer ids a model preset's ``size`` ids stand for (int32, by model id):
    the tokens most frequent in the training text among those that are whole UTF-8
    characters on their own (so any sequence of them is valid text), ties by id."""
    from fabric.serving.detok import byte_table

    d = Path(assets_dir)
    table = byte_table(load_tokenizer(d))
    ids = np.load(d / "corpus_ids.npy")
    counts = np.bincount(ids, minlength=len(table))

    def whole(raw: bytes) -> bool:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return bool(raw)

    ok = np.array([whole(bytes(table[i])) for i in range(len(table))])
    order = np.lexsort((np.arange(len(table)), -counts))  # most frequent first, then by id
    chosen = order[ok[order]][:size]
    if chosen.size < size:
        raise ValueError(f"the tokenizer has {chosen.size} whole-character tokens, "
                         f"fewer than the model's {size} ids")
    return chosen.astype(np.int32)


@dataclass(frozen=True)
class CorpusWalk:
    """Maps toy-decoder ids to tokenizer ids by walking the tokenized text."""

    ids: np.ndarray  # int32 tokenizer ids of the training text
    jump_ok: np.ndarray  # bool: token i starts a line (so on a character boundary)
    line_starts: np.ndarray  # int64 jump targets (safe line starts)

    @classmethod
    def load(cls, assets_dir: str | Path) -> CorpusWalk:
        """Read the walk's arrays from the cache folder."""
        d = Path(assets_dir)
        return cls(np.load(d / "corpus_ids.npy"), np.load(d / "jump_ok.npy"),
                   np.load(d / "line_starts.npy"))

    def start_for(self, prompt_ids: list[int], seed: int | None = None) -> int:
        """Where a prompt's sequence starts: a line start chosen by a hash of the prompt
        (and of the request's seed, when it samples with one)."""
        h = zlib.crc32(np.asarray(prompt_ids, dtype=np.int64).tobytes())
        if seed is not None:
            h = zlib.crc32((seed & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"), h)
        return int(self.line_starts[h % self.line_starts.size])

    def step(self, toy: np.ndarray, cursors: np.ndarray) -> np.ndarray:
        """Token ids for one step; advances ``cursors`` (int64, in place)."""
        toy64 = toy.astype(np.int64)
        jump = (toy64 % JUMP_EVERY == 0) & self.jump_ok[cursors]
        if jump.any():
            targets = self.line_starts[(toy64 // JUMP_EVERY) % self.line_starts.size]
            np.copyto(cursors, targets, where=jump)
        out = self.ids[cursors]
        cursors += 1
        cursors[cursors >= self.ids.size] = 0  # the text ends on a boundary: wrap to its start
        return out
