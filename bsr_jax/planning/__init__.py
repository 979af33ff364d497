"""Planning a step into a memory budget: the search and ``Plan`` (``search``), its options
(``options``), and the two model families it rewrites, linen (``linen``) and NNX (``nnx``),
siblings that share nothing with each other.
May import: every other part.
"""
