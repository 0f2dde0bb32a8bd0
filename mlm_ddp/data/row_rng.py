"""Each row's masking draws for a whole batch at once: numpy's PCG64 per row, emulated and checked.

A row's mask comes from its own generator, numpy's PCG64 seeded by SeedSequence([seed, split, epoch,
digest]) (`generator`; data.masking.sample_rng). It is named here, never taken from `default_rng`, so that
a numpy whose default generator is another one still draws the same masks on both paths below. Building
one costs ~30 us (SeedSequence's hashing, then PCG64's set-up) and each of its draws ~2-6 us, so a 256 x 128
batch spends ~25 ms of the host's time per step in `numpy_draws`, which asks each row's generator. In
`batched_draws` the SeedSequence hashing runs once for the batch, vectorised over rows; one reused PCG64 is
put in each row's state and hands over its raw 64-bit outputs in one call; and the uniform doubles and the
bounded integers are made from those outputs with numpy's own arithmetic, for the batch at once.

That arithmetic follows numpy's sources (numpy/random/bit_generator.pyx: SeedSequence; pcg64.c:
pcg64_set_seed, pcg64_next_double; distributions.c: buffered_bounded_lemire_uint32) and is not numpy's
API: a release may compute its draws otherwise. So `draws`, which the collator calls, takes the emulation
only where `emulation_holds`: once per process, the emulation is compared with numpy's own PCG64 on
generated rows (SeedSequence's edge cases, both halves of a raw output, a bound that rejects half its
draws). Where it differs, every batch of the process is drawn by numpy's own generators, row by row, and one
log line names numpy's version: slower, the same numbers. Both paths draw from one generator per row,
`generator`'s PCG64 (the emulation's rare row with a rejected integer asks it for that row's integers).

Why a check and not a generator of mlm_ddp's own: the masks stay numpy's PCG64 draws, bit for bit on the
installed numpy, so a checkpoint needs no version of its masks' generator. The price: numpy does not promise
a Generator's stream across releases, and where a release changes PCG64's draws the masks change with it,
on both paths alike (the golden masks of tests/test_row_rng.py fail on such a release, so it is seen before
a run resumes across it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

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


def generator(entropy: Sequence[int]) -> np.random.Generator:
    """A row's generator: numpy's PCG64 seeded by SeedSequence(entropy), a list of non-negative ints."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def raw_draws(entropies: Sequence[Sequence[int]], counts: np.ndarray) -> np.ndarray:
    """Row b's first counts[b] raw outputs of `generator(entropies[b]).bit_generator`, emulated.

    Returns (B, max(counts, 1)) uint64, zero past each row's count.
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


def numpy_draws(entropies: Sequence[Sequence[int]], doubles: np.ndarray, integers: np.ndarray,
                high: int) -> tuple[np.ndarray, np.ndarray]:
    """Row b's `generator(entropies[b])`: its random(doubles[b]), then its integers(0, high, integers[b]).

    Returns the doubles (B, max(doubles, 1)) float64 and the integers (B, max(integers, 1)) int64, zero past
    each row's counts.
    """
    uniforms = np.zeros((len(entropies), max(int(doubles.max(initial=0)), 1)), dtype=np.float64)
    values = np.zeros((len(entropies), max(int(integers.max(initial=0)), 1)), dtype=np.int64)
    for row, entropy in enumerate(entropies):
        rng = generator(entropy)
        uniforms[row, : doubles[row]] = rng.random(int(doubles[row]))
        values[row, : integers[row]] = rng.integers(0, high, int(integers[row]))
    return uniforms, values


def batched_draws(entropies: Sequence[Sequence[int]], doubles: np.ndarray, integers: np.ndarray,
                  high: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy_draws's numbers from the emulation, for the batch at once; 0 < high < 2**32.

    The integers start at the raw output after the doubles, two to an output (halves). A row whose draw
    Lemire's method rejects (bounded) asks its own generator for its integers: rare, and the same numbers.
    """
    raw = raw_draws(entropies, doubles + (integers + 1) // 2)  # (B, K)
    width = max(int(doubles.max(initial=0)), 1)
    uniforms = np.where(np.arange(width) < doubles[:, None], uniform(raw[:, :width]), 0.0)  # (B, D)
    steps = np.arange(max(int(integers.max(initial=0)), 1))
    pairs = np.take_along_axis(raw, np.minimum(doubles[:, None] + steps // 2, raw.shape[1] - 1), axis=1)  # (B, N)
    values, rejected = bounded(halves(pairs), high)
    inside = steps < integers[:, None]
    values[~inside] = 0
    for row in np.flatnonzero((rejected & inside).any(axis=1)):
        rng = generator(entropies[row])
        rng.random(int(doubles[row]))
        values[row, : integers[row]] = rng.integers(0, high, int(integers[row]))
    return uniforms, values


# The rows the emulation is checked on: the collator's own form [seed, split, epoch, digest], then
# SeedSequence's edges (0; a word's top; values of two and three words; entropy past its pool of four words),
# each with its own count of doubles (odd and even, so the integers start at an odd and an even raw output).
CHECK_ENTROPIES: tuple[tuple[int, ...], ...] = (
    (42, 0, 0, 2134822173486100501), (0,), (2**32 - 1,), (2**32, 1, 2), (2**64 - 1, 2**63 + 5, 7, 9, 11),
    (2**70 + 3,), (1, 2, 3, 4, 5, 6, 7, 8, 9), (2**63 + 5, 1, 2, 2**64 - 1),
)
# a BERT vocabulary's ordinary ids; 1,073,742 (Lemire's threshold just under the bound); 2**31 + 1, which
# rejects half its draws, so that the rejection threshold itself is compared
CHECK_BOUNDS = (30_518, 1_073_742, 2**31 + 1)
CHECK_INTEGERS = 24


def emulation_differs() -> str | None:
    """What of the emulation differs from numpy's own generators on CHECK_ENTROPIES; None where nothing does."""
    doubles = np.arange(len(CHECK_ENTROPIES)) + 7
    # (B, K): the doubles, then twice the halves the integers need, for the draws a threshold rejects
    raw = raw_draws(CHECK_ENTROPIES, doubles + CHECK_INTEGERS)
    for row, entropy in enumerate(CHECK_ENTROPIES):
        count = int(doubles[row]) + CHECK_INTEGERS
        if not np.array_equal(raw[row, :count], generator(entropy).bit_generator.random_raw(count)):
            return f"PCG64's raw outputs of SeedSequence({list(entropy)}) differ"
        pairs = raw[row, doubles[row] + np.arange(2 * CHECK_INTEGERS) // 2]
        for high in CHECK_BOUNDS:
            rng = generator(entropy)
            if not np.array_equal(uniform(raw[row, : doubles[row]]), rng.random(int(doubles[row]))):
                return f"Generator.random of SeedSequence({list(entropy)}) differs"
            values, rejected = bounded(halves(pairs), high)
            accepted = values[~rejected][:CHECK_INTEGERS]  # numpy's values: the draws its threshold accepts
            if not np.array_equal(accepted, rng.integers(0, high, CHECK_INTEGERS)[: accepted.size]):
                return f"Generator.integers(0, {high}) of SeedSequence({list(entropy)}) differs"
    return None


@functools.cache
def emulation_holds() -> bool:
    """Whether the emulation draws numpy's numbers (emulation_differs), checked once per process; where it
    does not, one log line says so, with numpy's version."""
    try:
        differs = emulation_differs()
    except Exception as err:  # noqa: BLE001 - an emulation that cannot run on this numpy does not hold
        differs = f"it raises {type(err).__name__}: {err}"
    if differs is not None:
        logger.warning("mlm_ddp's emulation of numpy's PCG64 (mlm_ddp.data.row_rng) does not hold on numpy %s: %s; "
                       "every row's masks are drawn by numpy's own PCG64, row by row (slower)", np.__version__, differs)
    return differs is None


def draws(entropies: Sequence[Sequence[int]], doubles: np.ndarray, integers: np.ndarray,
          high: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's doubles then integers in [0, high), as numpy_draws: the whole batch by the emulation
    where it holds, else the whole batch by numpy's own generators."""
    if emulation_holds():
        return batched_draws(entropies, doubles, integers, high)
    return numpy_draws(entropies, doubles, integers, high)
