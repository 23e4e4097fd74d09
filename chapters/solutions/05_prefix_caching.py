"""Chapter 05's answers. Under pytest each is held against its exercise's check (chapters/exercises.py)."""

ANSWERS = {
    "1": 64,  # the first 70 tokens agree: 4 whole blocks (64 tokens); block 4 differs from token 70 on
    "2": 8,  # blocks 0-4 come from the cache; the last block holds the last prompt token and is recomputed whole
    "3": 4,  # the queue is 5, 4, 3, 2, 1, 0; block 5 never held tokens, so 4 (seq 1's tail) is the first cached
    "4": 0,  # the adapter's name is in every hash: another adapter's K and V are other numbers
}
