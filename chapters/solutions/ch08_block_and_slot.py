"""Reference solution, chapter 08: where a position's K and V are in the paged cache."""


def my_block_and_slot(block_table, positions, block_size):
    logical = positions // block_size  # which of the request's blocks, in order
    blocks = block_table[logical]  # the block table maps it to a physical block, anywhere in the cache
    slots = positions % block_size  # the row inside that block
    return blocks, slots
