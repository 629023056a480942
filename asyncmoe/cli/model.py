"""What `demo` and `generate` share as they run: the model's config checked before its weights load,
the prompt encoded, the new tokens streamed."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable


def check_config(config, cache: int | str, tokens: int | None = None, prompt: int = 0) -> None:
    """What the options ask of the model, checked from its config before its weights load: slots
    below its top_k are an error; a prompt and `tokens` past its positions a warning, as
    transformers' generate gives (the Decoder then says it again once the model has loaded;
    `said_once` keeps that quiet)."""
    from ..integrations.transformers import top_k_of

    text = config.get_text_config()
    k = top_k_of(text)
    if isinstance(cache, int) and k is not None and cache < k:
        raise ValueError(
            f"--cache {cache} is below the model's top_k={k}: every token needs its {k} experts "
            "resident at once; "
            f"use --cache {k} or more"
        )
    positions = getattr(text, "max_position_embeddings", None)
    if tokens is not None and positions is not None and prompt + tokens > positions:
        fits = (
            f"--tokens {positions - prompt} stays within them"
            if prompt < positions
            else "shorten the prompt"
        )
        print(
            f"asyncmoe: warning: the prompt's {prompt} tokens and --tokens {tokens} run to "
            f"position {prompt + tokens}, "
            f"past the model's {positions} (config.max_position_embeddings): depending on the "
            "model, expect "
            f"exceptions, degenerate text or nothing at all past them; {fits}",
            file=sys.stderr,
        )


@contextlib.contextmanager
def said_once():
    """The warning about positions past max_position_embeddings, already printed by `check_config`,
    not again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*max_position_embeddings")
        yield


def encode(tokenizer, prompt: str):
    """The prompt's ids [1, L]; a prompt of no tokens is refused."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, L]
    if ids.shape[1] == 0:
        raise ValueError(
            f"--prompt {prompt!r} encodes to no tokens: give the model some text to continue"
        )
    return ids


def stream(tokenizer, ids) -> Callable[[list[int]], None]:
    """Prints the prompt and returns the Decoder's callback that prints what each new token adds to
    the decoded text."""
    text = ids[0].tolist()

    def show(tokens: list[int]) -> None:
        before = tokenizer.decode(text)
        text.append(tokens[0])
        print(tokenizer.decode(text)[len(before) :], end="", flush=True)

    print(tokenizer.decode(text), end="", flush=True)
    return show
