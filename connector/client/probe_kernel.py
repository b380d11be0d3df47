"""The lookup index's probe, compiled by numba when this module is imported: one loop from
each hash's home record to the hash or an empty record. Imported only by ``index_reader``'s
``load_probe``, on a thread of the client's, never when kvtier is imported (see there why).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from kvtier.proto.lookup_index import HASH_MIX, HOST, MAX_PROBES

_WORDS = types.Array(types.uint64, 2, "C", readonly=True)
_PROBE_SIGNATURE = types.UniTuple(types.int64, 2)(
    _WORDS,
    types.Array(types.uint8, 1, "A", readonly=True),
    _WORDS,
    types.uint64,
    types.uint8[::1],
    types.boolean,
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


@_compiled
def walk_table(words, tiers, want, shift, bits, prefix):
    """Writes each wanted hash's tier bits into ``bits`` (left 0 on a miss) and returns how
    many hashes it walked and how many of those the host tier holds; with ``prefix`` it stops
    at the first miss, as a lookup does. ``words`` are the table's records as 64-bit words
    (the hash's two first), ``want`` the hashes as two words each, ``shift`` the table's
    (``Table.shift``); a hash is mixed as the writer's ``_buckets`` mixes it. No read leaves
    the map: a home record is below the capacity (by the shift), so is each next one (by the
    mask), and the reader checked that the file holds that many records."""
    mask = words.shape[0] - 1
    mix = np.uint64(HASH_MIX)
    host = 0
    for i in range(want.shape[0]):
        low, high = want[i, 0], want[i, 1]
        record = np.int64(((low ^ (high * mix)) * mix) >> shift)
        for _ in range(MAX_PROBES):
            first, second = words[record, 0], words[record, 1]
            if first == low and second == high:
                bits[i] = tiers[record]
                break
            if first == 0 and second == 0:
                break
            record = (record + 1) & mask
        if bits[i] & HOST:
            host += 1
        elif prefix and not bits[i]:
            return i, host
    return want.shape[0], host
