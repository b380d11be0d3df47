"""The lookup index's probe, compiled by numba when this module is imported: one loop from
each hash's home record to the hash or an empty record. Imported only by ``index_reader``'s
``load_probe``, on a thread of the client's, never when kvtier is imported (see there why).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from kvtier.proto.lookup_index import HASH_MIX, HOST, MAX_PROBES, TIERS_WORD

_PROBE_SIGNATURE = types.Tuple((types.int64, types.int64))(
    types.Array(types.uint64, 2, "C", readonly=True),
    types.Bytes(types.uint8, 1, "C", readonly=True),
    types.boolean,
    types.uint8[::1],
)


def _compiled(function):
    """``function`` compiled now, for the signature the reader calls it with. The machine
    code is cached beside the module or in the user's cache (``NUMBA_CACHE_DIR`` chooses),
    and compiled afresh in each process where neither can be written (numba refuses to cache
    then, and an engine must start)."""
    try:
        return numba.njit(_PROBE_SIGNATURE, cache=True)(function)
    except RuntimeError:  # no writable cache location
        return numba.njit(_PROBE_SIGNATURE)(function)


def entry_point(compiled):
    """The machine code behind ``compiled``, called without numba's dispatcher: the dispatcher
    matches each call's argument types against its signatures first, which after a paced
    client's idle pause cost more than the walk of 1,000 hashes (on the 2-core VM a one-hash
    probe took 54 to 62 µs through it, 47 to 51 without it). The arguments must then have the
    signature's types exactly; others raise ``TypeError``."""
    (signature,) = compiled.signatures
    return compiled.overloads[signature].entry_point


@_compiled
def walk_table(words, packed, prefix, bits):
    """How many hashes it walked and how many of those the host tier holds; with ``prefix``
    it stops at the first miss, as a lookup does. Each walked hash's tier bits (0 on a miss)
    go to ``bits`` unless it is empty (a lookup of one call needs only the counts); past the
    first miss they are left as they were.

    ``words`` are the table's records as 64-bit words (the hash's two first, the tier bits the
    low byte of ``TIERS_WORD``); ``packed`` is the hashes' bytes end to end, two words each,
    little-endian as the table's (its length a multiple of 16, which the caller checks). A
    hash is mixed as the writer's ``_buckets`` mixes it. No read leaves the map: a home
    record is below the capacity (a power of two, by the shift), so is each next one (by the
    mask), and the reader checked that the file holds that many records.

    The whole lookup is this one call, its few arguments and its answer made here: on a VM a
    process that slept runs its first few hundred microseconds several times slower, and each
    numpy call or argument a paced client's lookup makes costs tens of microseconds then:
    the hashes' view is made here, not by the caller (a cold ``np.frombuffer`` and an array
    argument cost 37 µs after a 20 ms pause where the bytes passed in cost 20), and no array
    is made for the answer (an array handed back cost 20 to 30 µs of a 1,000-hash probe's
    75 to 85 after that pause)."""
    capacity = words.shape[0]
    mask = capacity - 1
    shift = np.uint64(64)
    while capacity > 1:
        capacity >>= 1
        shift -= np.uint64(1)
    mix = np.uint64(HASH_MIX)
    want = np.frombuffer(packed, np.uint64)
    count = want.shape[0] // 2
    keep = bits.shape[0] > 0
    if keep and bits.shape[0] < count:
        raise ValueError("the tier bits' array is shorter than the hashes")
    host = 0
    for i in range(count):
        low, high = want[2 * i], want[2 * i + 1]
        record = np.int64(((low ^ (high * mix)) * mix) >> shift)
        found = 0
        for _ in range(MAX_PROBES):
            first, second = words[record, 0], words[record, 1]
            if first == low and second == high:
                found = words[record, TIERS_WORD] & 0xFF
                break
            if first == 0 and second == 0:
                break
            record = (record + 1) & mask
        if keep:
            bits[i] = found
        if found & HOST:
            host += 1
        elif prefix and not found:
            return i, host
    return count, host
