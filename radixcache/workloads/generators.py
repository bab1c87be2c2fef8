"""Synthetic workloads: a multi-turn chat (``synthetic_chat``) and streams of insert/exists
calls over a shallow tree (``exercise_ops``) and a deep one (``deep_exercise_ops``). The same
arguments always give the same requests or calls.
"""

from __future__ import annotations

import numpy as np

from .requests import Request

__all__ = ["deep_exercise_ops", "exercise_ops", "synthetic_chat"]

#: Vocabulary of the synthetic workloads (a Llama-sized tokenizer).
_VOCAB = 32000


def _check_ranges(**ranges: tuple[int, int]) -> None:
    """ValueError for the first of ``ranges`` that is not a pair ``0 <= low <= high``."""
    for name, bounds in ranges.items():
        if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
            raise ValueError(f"{name} must be a (low, high) pair with 0 <= low <= high")


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    """A uniform int in the inclusive range ``bounds``."""
    low, high = bounds
    return int(rng.integers(low, high + 1))


def _random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, _VOCAB, size=n, dtype=np.int64)


def synthetic_chat(num_conversations: int = 300, num_system_prompts: int = 16,
                   turns: tuple[int, int] = (2, 6), seed: int = 0,
                   system_prompt_len: tuple[int, int] = (800, 2000),
                   user_len: tuple[int, int] = (20, 200),
                   output_len: tuple[int, int] = (20, 300)) -> list[Request]:
    """A multi-turn chat workload: conversations over a few shared system prompts.

    Turn k's prompt is the system prompt, every earlier user message and answer, then the new
    user message; its answer (``Request.output``) is fixed in advance so that turn k+1 quotes it.
    Conversations interleave in a random order while each keeps its turns in order. All ranges
    are inclusive; the same arguments always give the same requests.

    Args:
        num_conversations: How many conversations, an int >= 0.
        num_system_prompts: How many distinct system prompts they share, an int >= 1.
        turns: The (low, high) range of turns per conversation.
        seed: The random seed.
        system_prompt_len: The (low, high) range of a system prompt's length in tokens.
        user_len: The (low, high) range of a user message's length in tokens.
        output_len: The (low, high) range of an answer's length in tokens.

    Returns:
        The ``Request`` objects, in arrival order.

    Raises:
        ValueError: a count below its minimum, or a range that is not ``0 <= low <= high``.
    """
    if num_conversations < 0 or num_system_prompts < 1:
        raise ValueError("need num_conversations >= 0 and num_system_prompts >= 1")
    _check_ranges(turns=turns, system_prompt_len=system_prompt_len, user_len=user_len,
                  output_len=output_len)
    rng = np.random.default_rng(seed)
    system_prompts = [_random_tokens(rng, _between(rng, system_prompt_len))
                      for _ in range(num_system_prompts)]

    conversations: list[list[Request]] = []
    for _ in range(num_conversations):
        history = [system_prompts[int(rng.integers(num_system_prompts))]]
        conversation = []
        for _turn in range(_between(rng, turns)):
            history.append(_random_tokens(rng, _between(rng, user_len)))
            answer = _random_tokens(rng, _between(rng, output_len))
            conversation.append(Request(np.concatenate(history), len(answer), answer))
            history.append(answer)
        conversations.append(conversation)

    # One slot per turn, shuffled: conversation c's n-th slot serves its n-th turn.
    slots = np.repeat(np.arange(num_conversations), [len(c) for c in conversations])
    rng.shuffle(slots)
    next_turn = [0] * num_conversations
    requests = []
    for conv in slots.tolist():
        requests.append(conversations[conv][next_turn[conv]])
        next_turn[conv] += 1
    return requests


def exercise_ops(num_ops: int = 100_000, seed: int = 0, base_len: tuple[int, int] = (100, 2000),
                 num_bases: int = 50, tail_len: tuple[int, int] = (1, 20),
                 ) -> list[tuple[str, list[int]]]:
    """A stream of ``("insert" | "exists", tokens)`` calls over long shared prefixes.

    Every sequence is one of ``num_bases`` long base prefixes (``base_len`` tokens) plus a short
    tail (``tail_len``). About half the calls are inserts, drawn from a pool of distinct
    sequences (so later inserts often repeat earlier ones, as a server re-inserting a prompt
    does); the exists queries are split between sequences inserted before, bare prefixes of a
    base (cached but usually not inserted as such) and sequences never inserted. Token lists are
    shared between calls to keep memory bounded; callers must not modify them.

    Args:
        num_ops: How many calls, an int >= 0.
        seed: The random seed (the same arguments give the same calls).
        base_len: The (low, high) range of a base prefix's length in tokens.
        num_bases: How many base prefixes, an int >= 1.
        tail_len: The (low, high) range of a tail's length in tokens.

    Returns:
        ``num_ops`` pairs ``("insert" | "exists", tokens)``, tokens a list of ints.

    Raises:
        ValueError: a count below its minimum, or a range that is not ``0 <= low <= high``.
    """
    if num_ops < 0 or num_bases < 1:
        raise ValueError("need num_ops >= 0 and num_bases >= 1")
    _check_ranges(base_len=base_len, tail_len=tail_len)
    rng = np.random.default_rng(seed)
    bases = [_random_tokens(rng, _between(rng, base_len)).tolist() for _ in range(num_bases)]

    def with_tails(count: int, low: int) -> list[list[int]]:
        # Tails of inserted sequences use ids below _VOCAB, never-inserted ones ids above it.
        base_ids = rng.integers(num_bases, size=count).tolist()
        lengths = rng.integers(tail_len[0], tail_len[1] + 1, size=count)
        tails = rng.integers(low, low + _VOCAB, size=int(lengths.sum()), dtype=np.int64).tolist()
        ends = np.cumsum(lengths).tolist()
        starts = [0] + ends[:-1]
        return [bases[b] + tails[s:e] for b, s, e in zip(base_ids, starts, ends)]

    is_insert = rng.random(num_ops) < 0.5
    num_inserts = int(is_insert.sum())
    num_exists = num_ops - num_inserts
    # Distinct sequences: about five calls per sequence on average.
    insert_pool = with_tails(max(1, num_inserts // 5), 0)
    prefix_pool = []
    for base_id in rng.integers(num_bases, size=max(1, num_exists // 10)).tolist():
        base = bases[base_id]
        prefix_pool.append(base[: int(rng.integers(1, len(base) + 1))] if base else [])
    unseen_pool = with_tails(max(1, num_exists // 10), _VOCAB)

    insert_choice = rng.integers(len(insert_pool), size=num_ops).tolist()
    exists_kind = rng.integers(3, size=num_ops).tolist()
    exists_choice = rng.random(num_ops).tolist()
    ops: list[tuple[str, list[int]]] = []
    inserted: list[int] = []  # insert_pool indices in first-insert order
    seen = set()
    for i, insert in enumerate(is_insert.tolist()):
        if insert:
            choice = insert_choice[i]
            if choice not in seen:
                seen.add(choice)
                inserted.append(choice)
            ops.append(("insert", insert_pool[choice]))
            continue
        kind = exists_kind[i]
        if kind == 0 and inserted:
            tokens = insert_pool[inserted[int(exists_choice[i] * len(inserted))]]
        elif kind == 1:
            tokens = prefix_pool[int(exists_choice[i] * len(prefix_pool))]
        else:
            tokens = unseen_pool[int(exists_choice[i] * len(unseen_pool))]
        ops.append(("exists", tokens))
    return ops


def deep_exercise_ops(num_ops: int = 100_000, seed: int = 0, num_bases: int = 200,
                      prefix_len: tuple[int, int] = (100, 2000),
                      tail_len: tuple[int, int] = (1, 20), vocab: int = _VOCAB,
                      repeat_share: float = 0.2) -> list[tuple[str, list[int]]]:
    """Insert/exists calls over a deep tree: prefixes of random length of shared bases.

    Every inserted sequence is a prefix of one of ``num_bases`` bases (its length drawn from
    ``prefix_len``) plus a short fresh tail (``tail_len``), so each insert cuts its base's
    chain at a new place: after 10^5 calls the tree has about 9*10^4 nodes and an inserted
    sequence ends about 100 nodes deep. ``repeat_share`` of the inserts repeat an earlier
    one. The exists queries are split between inserted sequences, bare base prefixes and
    never-inserted sequences (tail ids from ``[vocab, 2 * vocab)``). Token ids lie below
    ``2 * vocab``; the same arguments give the same calls. Token lists share their int objects
    with the bases; callers must not modify them.

    Args:
        num_ops: How many calls, an int >= 0.
        seed: The random seed.
        num_bases: How many bases, an int >= 1.
        prefix_len: The (low, high) range of the base prefix an insert takes, in tokens.
        tail_len: The (low, high) range of a tail's length in tokens.
        vocab: Token ids of bases lie below it, those of never-inserted tails in
            ``[vocab, 2 * vocab)``; an int >= 1.
        repeat_share: The share of inserts that repeat an earlier one, in [0, 1].

    Returns:
        ``num_ops`` pairs ``("insert" | "exists", tokens)``, tokens a list of ints.

    Raises:
        ValueError: a count below its minimum, or a range that is not ``0 <= low <= high``.
    """
    if num_ops < 0 or num_bases < 1 or vocab < 1:
        raise ValueError("need num_ops >= 0, num_bases >= 1 and vocab >= 1")
    _check_ranges(prefix_len=prefix_len, tail_len=tail_len)
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, vocab, size=prefix_len[1], dtype=np.int64).tolist()
             for _ in range(num_bases)]

    def fresh(low: int) -> list[int]:
        base = bases[int(rng.integers(num_bases))]
        cut = _between(rng, prefix_len)
        tail = rng.integers(low, low + vocab, size=_between(rng, tail_len)).tolist()
        return base[:cut] + tail

    ops: list[tuple[str, list[int]]] = []
    inserted: list[list[int]] = []
    for insert in (rng.random(num_ops) < 0.5).tolist():
        if insert:
            if inserted and rng.random() < repeat_share:
                tokens = inserted[int(rng.integers(len(inserted)))]
            else:
                tokens = fresh(0)
                inserted.append(tokens)
            ops.append(("insert", tokens))
            continue
        kind = int(rng.integers(3))
        if kind == 0 and inserted:
            tokens = inserted[int(rng.integers(len(inserted)))]
        elif kind == 1:
            tokens = bases[int(rng.integers(num_bases))][: _between(rng, prefix_len)]
        else:
            tokens = fresh(vocab)
        ops.append(("exists", tokens))
    return ops
