"""The demo's reward: how often the policy writes a target character.

``reward(completion) = fraction of its tokens whose text contains the target
character`` (default ``e``). Chosen because it is easy to see (the sample column
fills with e's), starts well above zero with a random model (about one token in
five of the tiny BPE vocabulary contains an ``e``), and decomposes into one reward
per token, which lets the policy gradient give each token its own advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from weightwire._extras import require
from weightwire.shared.errors import ConfigError


class CharReward:
    """Per-token hits ``mask[token_id]`` from the decoded text of every vocabulary id."""

    def __init__(
        self, pieces: Sequence[str], char: str = "e", *, n_tokens: int | None = None
    ) -> None:
        if len(char) != 1:
            raise ConfigError(f"the target must be one character, got {char!r}")
        self.char = char
        self.pieces = list(pieces)
        self.n_tokens = len(self.pieces) if n_tokens is None else n_tokens
        """Ids below this are real tokenizer tokens (the model's vocab may be padded past it)."""
        self.mask = np.array([char in p for p in self.pieces], dtype=bool)
        if not self.mask.any():
            raise ConfigError(
                f"no token of the vocabulary contains {char!r}: the reward could never rise"
            )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, char: str = "e") -> CharReward:
        """Decode every id ``< vocab_size`` with the directory's ``tokenizer.json``.

        Ids past the tokenizer's vocabulary (padded embedding rows) decode to ``""``.
        """
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"{model_dir} has no tokenizer.json; the reward needs the token texts"
            )
        require("tokenizers", purpose="decoding the token texts")
        from tokenizers import Tokenizer  # Rust library, torch-free

        tok = Tokenizer.from_file(str(path))
        n = tok.get_vocab_size()
        pieces = [tok.decode([i]) if i < n else "" for i in range(vocab_size)]
        return cls(pieces, char, n_tokens=min(n, vocab_size))

    def hits(self, token_ids: np.ndarray) -> np.ndarray:
        """``float32`` array shaped like ``token_ids``: 1 where the token contains the target."""
        ids = np.asarray(token_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.mask)):
            raise ValueError(f"token id outside the vocabulary [0, {len(self.mask)})")
        return self.mask[ids].astype(np.float32)

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """Per-completion reward (rows of ``token_ids``): the fraction of hits."""
        return self.hits(token_ids).mean(axis=-1)

    def text(self, token_ids: Sequence[int]) -> str:
        """Concatenated token texts (for display)."""
        return "".join(self.pieces[int(t)] for t in token_ids)

    @property
    def base_rate(self) -> float:
        """The reward of a uniformly random policy."""
        return float(self.mask.mean())
