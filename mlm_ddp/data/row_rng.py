"""Each row's masking draws for a whole batch at once, bit-identical to numpy's generator per row.

A row's mask comes from its own generator, `numpy.random.default_rng([seed, split, epoch, digest])`
(data.masking.sample_rng). Building one costs ~30 us (SeedSequence's hashing, then PCG64's set-up) and
each of its three draws ~2-6 us, so a 256 x 128 batch spent ~25 ms of the host's time per step there.
Here the SeedSequence hashing runs once for the batch, vectorised over rows; one reused PCG64 is put in
each row's state and hands over its raw 64-bit outputs in one call; and the uniform doubles and the
bounded integers are made from those outputs with numpy's own arithmetic, for the batch at once. The
result is the same numbers, bit for bit (tests/test_row_rng.py checks them against numpy on generated
cases), so no mask changes and a resumed run still sees the masks of the uninterrupted one.

The arithmetic follows numpy's sources (numpy/random/bit_generator.pyx: SeedSequence; pcg64.c:
pcg64_set_seed, pcg64_next_double; distributions.c: buffered_bounded_lemire_uint32).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK32 = 0xFFFFFFFF
_MASK128 = (1 << 128) - 1
# SeedSequence's constants (numpy/random/bit_generator.pyx)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_POOL = 4
_PCG_MULTIPLIER = 0x2360ED051FC65DA44385DF649FCCF645  # PCG_DEFAULT_MULTIPLIER_128


def int_words(value: int) -> list[int]:
    """An entropy int as SeedSequence reads it: its 32-bit words, least significant first; 0 is [0]."""
    words = [value & _MASK32]
    value >>= 32
    while value:
        words.append(value & _MASK32)
        value >>= 32
    return words


def _hashmix(values: np.ndarray, hash_const: int) -> tuple[np.ndarray, int]:
    """SeedSequence's hashmix on a (B,) uint32 column; the constant advances the same for every row."""
    values = values ^ np.uint32(hash_const)
    hash_const = (hash_const * _MULT_A) & _MASK32
    values = values * np.uint32(hash_const)
    return values ^ (values >> np.uint32(16)), hash_const


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
    return result ^ (result >> np.uint32(16))


def pool_states(entropy: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """PCG64's (state, inc) for each row's SeedSequence(entropy[b, :lengths[b]]), as Python ints.

    entropy: (B, L) uint32, each row's words, zero beyond its length (every row has at least one word).
    """
    rows, width = entropy.shape
    mixer = np.zeros((_POOL, rows), dtype=np.uint32)
    hash_const = _INIT_A
    with np.errstate(over="ignore"):  # every product here is meant modulo 2**32
        for i in range(_POOL):
            # a row shorter than the pool mixes zeros in, as SeedSequence does
            column = entropy[:, i] if i < width else np.zeros(rows, dtype=np.uint32)
            mixer[i], hash_const = _hashmix(column, hash_const)
        for i_src in range(_POOL):
            for i_dst in range(_POOL):
                if i_src != i_dst:
                    hashed, hash_const = _hashmix(mixer[i_src], hash_const)
                    mixer[i_dst] = _mix(mixer[i_dst], hashed)
        for i_src in range(_POOL, width):
            # words past the pool: only rows that have them; the constant's course past a row's last word
            # no longer matters to it (generate_state starts again from INIT_B)
            longer = lengths > i_src
            for i_dst in range(_POOL):
                hashed, hash_const = _hashmix(entropy[:, i_src], hash_const)
                mixer[i_dst] = np.where(longer, _mix(mixer[i_dst], hashed), mixer[i_dst])
        # generate_state(4, uint64): 8 words drawn from the pool in turn, pairs read as little-endian uint64
        words = np.empty((8, rows), dtype=np.uint64)
        hash_const = _INIT_B
        for i in range(8):
            value = mixer[i % _POOL] ^ np.uint32(hash_const)
            hash_const = (hash_const * _MULT_B) & _MASK32
            value = value * np.uint32(hash_const)
            words[i] = value ^ (value >> np.uint32(16))
    halves = (words[0::2] | (words[1::2] << np.uint64(32))).T.tolist()  # (B, 4) uint64 as ints
    states = []
    for high_state, low_state, high_seq, low_seq in halves:
        # pcg64_srandom_r: inc = 2 * initseq + 1; state = 0; step; state += initstate; step
        inc = (((high_seq << 64) | low_seq) << 1 | 1) & _MASK128
        state = (inc + ((high_state << 64) | low_state)) & _MASK128
        states.append(((state * _PCG_MULTIPLIER + inc) & _MASK128, inc))
    return states


def raw_draws(entropies: Sequence[Sequence[int]], counts: np.ndarray) -> np.ndarray:
    """Row b's first counts[b] raw outputs of `np.random.default_rng(entropies[b]).bit_generator`.

    Returns (B, max(counts, 1)) uint64, zero past each row's count. Each entropy is the list of
    non-negative ints that default_rng would be given.
    """
    words = [[w for value in entropy for w in int_words(value)] for entropy in entropies]
    lengths = np.fromiter((len(w) for w in words), dtype=np.int64, count=len(words))
    table = np.zeros((len(words), max(lengths.max(initial=1), 1)), dtype=np.uint32)
    for row, row_words in enumerate(words):
        table[row, : len(row_words)] = row_words
    # at least one column, so that a batch of empty rows still has a (B, 1) table to index
    out = np.zeros((len(words), max(int(counts.max(initial=0)), 1)), dtype=np.uint64)
    generator = np.random.PCG64(0)  # one object, put in each row's state in turn
    state = {"bit_generator": "PCG64", "state": {}, "has_uint32": 0, "uinteger": 0}
    for row, (pcg_state, inc) in enumerate(pool_states(table, lengths)):
        state["state"] = {"state": pcg_state, "inc": inc}
        generator.state = state
        out[row, : counts[row]] = generator.random_raw(int(counts[row]))
    return out


def uniform(raw: np.ndarray) -> np.ndarray:
    """Generator.random's doubles in [0, 1) from raw 64-bit outputs: the top 53 bits over 2**53."""
    return (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def halves(pairs: np.ndarray) -> np.ndarray:
    """Token t's 32-bit draw: the low half of pairs[..., t] for even t, its high half for odd t.

    numpy's bounded integers split each raw output in two, low half first (buffered_uint32), so draw t
    of a row lies in its raw output t // 2: pairs holds that output at each t. Returns uint64 < 2**32.
    """
    odd = (np.arange(pairs.shape[-1]) % 2).astype(np.uint64)
    return (pairs >> (odd * np.uint64(32))) & np.uint64(_MASK32)


def bounded(draws: np.ndarray, high: int) -> tuple[np.ndarray, np.ndarray]:
    """Generator.integers(0, high, n) from a row's 32-bit draws (halves), for 0 < high < 2**32.

    Returns (values, rejected), int64 and bool, shaped like draws. numpy maps each draw to [0, high) by
    Lemire's multiply-shift; a draw that method rejects (rare: its product's low word below
    ((2**32 - high) mod high)) is replaced by the next draw, shifting every later value of its row, so
    `rejected` says where a row's values stop being numpy's.
    """
    product = draws * np.uint64(high)  # < 2**64: both factors are below 2**32
    rejected = (product & np.uint64(_MASK32)) < np.uint64(((1 << 32) - high) % high)
    return (product >> np.uint64(32)).astype(np.int64), rejected
