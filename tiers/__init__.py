"""The storage core: hashing, layout, GPU pool, host and disk tiers, copies and the walk."""
