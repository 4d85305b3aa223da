"""Prompts and arrival times for `semfab bench tokens` (``vllm bench serve`` habits).

Datasets (``--dataset``):

* ``corpus``: text of the tokenizer's training corpus (six scripts, written
  for semfab): one random line per prompt, or ``input_len`` tokens of running
  text from a random line on;
* ``sonnet``: random lines of Shakespeare's sonnets (public domain, shipped in
  ``data/prompts/sonnets.txt``) after a short instruction, as vllm's
  ``sonnet`` dataset builds them, until the prompt has ``input_len`` tokens;
* ``random``: random English words of the shipped text, ``input_len`` tokens.

Lengths are counted with semfab's own tokenizer, so they are estimates for
any other server's model; the benchmark reports the server's own count
(``usage.prompt_tokens``) when it sends one.

Arrivals (:func:`arrival_times`) follow vllm: the first request at once,
then gamma-distributed gaps of mean ``1 / rate`` and shape ``burstiness``
(1: a Poisson process; below 1 burstier, above 1 more regular).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fabric.serving.assets import DATA_DIR, corpus_files, corpus_text

DATASETS = ("corpus", "sonnet", "random")
SONNETS = DATA_DIR / "prompts" / "sonnets.txt"
#: The instruction before the sonnet lines (vllm's sonnet dataset asks the same).
SONNET_PREFIX = "Pick as many lines as you can from these poem lines:\n"
#: Default prompt length (tokens) of the datasets that need one.
DEFAULT_INPUT_LEN = {"sonnet": 64, "random": 32}
_WORD = re.compile(r"\b[A-Za-z][a-z']*[a-z]\b")


@dataclass(frozen=True)
class Prompt:
    """One prompt and its length in semfab's tokenizer."""

    text: str
    input_len: int


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of ``n`` requests.

    ``rate`` requests per second on average (``inf``: all at once); gaps are
    gamma-distributed with shape ``burstiness`` and scale
    ``1 / (rate * burstiness)``, so their mean is ``1 / rate`` whatever the
    shape.
    """
    if n <= 0:
        return np.zeros(0)
    if not math.isfinite(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text).ids)


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


@lru_cache(maxsize=1)
def _sonnet_lines() -> tuple[str, ...]:
    return tuple(_lines(Path(SONNETS).read_text(encoding="utf-8")))


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    english = [p for p in corpus_files() if p.name.startswith("en_")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in english)
    text += "\n" + Path(SONNETS).read_text(encoding="utf-8")
    return tuple(sorted({w.lower() for w in _WORD.findall(text)}))


def _corpus(n: int, rng: random.Random, input_len: int | None, tokenizer: Any) -> list[str]:
    text = corpus_text()
    if input_len is None:  # one line, as the benchmark always did
        lines = [ln for ln in _lines(text) if len(ln) > 12]
        return [rng.choice(lines)[:200] for _ in range(n)]
    starts = [0] + [m.end() for m in re.finditer("\n", text) if m.end() < len(text)]
    out = []
    for _ in range(n):
        start = rng.choice(starts)
        # enough characters for input_len tokens (a token is at least one byte)
        ids = tokenizer.encode(text[start: start + 8 * input_len + 64]).ids[:input_len]
        out.append(str(tokenizer.decode(ids)).rstrip("\ufffd"))  # no half character
    return out


def _sonnet(n: int, rng: random.Random, input_len: int, tokenizer: Any) -> list[str]:
    lines = _sonnet_lines()
    out = []
    for _ in range(n):
        parts = [SONNET_PREFIX]
        used = _count(tokenizer, SONNET_PREFIX)
        while used < input_len or len(parts) == 1:  # at least one line
            line = rng.choice(lines) + "\n"
            parts.append(line)
            used += _count(tokenizer, line)
        out.append("".join(parts))
    return out


def _random(n: int, rng: random.Random, input_len: int, tokenizer: Any) -> list[str]:
    words = _words()
    cost = {w: _count(tokenizer, " " + w) for w in words}
    out = []
    for _ in range(n):
        chosen: list[str] = []
        used = 0
        while used < input_len:
            w = rng.choice(words)
            chosen.append(w)
            used += cost[w]
        while _count(tokenizer, " ".join(chosen)) < input_len:  # the sum was an estimate
            chosen.append(rng.choice(words))
        out.append(" ".join(chosen))
    return out


def make_prompts(dataset: str, n: int, seed: int, tokenizer: Any,
                 input_len: int | None = None) -> list[Prompt]:
    """``n`` prompts of ``dataset`` (see the module docstring), the same for a seed."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    if input_len is not None and input_len < 1:
        raise ValueError("input length must be >= 1 token")
    rng = random.Random(seed)
    if dataset == "corpus":
        texts = _corpus(n, rng, input_len, tokenizer)
    else:
        length = input_len if input_len is not None else DEFAULT_INPUT_LEN[dataset]
        make = _sonnet if dataset == "sonnet" else _random
        texts = make(n, rng, length, tokenizer)
    return [Prompt(t, _count(tokenizer, t)) for t in texts]
