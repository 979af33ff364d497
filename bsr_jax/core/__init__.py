"""The ground floor: what every part needs and nothing of bsr_jax's own decides.

Owns: the batch-axis and mesh helpers (``sharding``), which platform a program is lowered for
(``platforms``), process-wide attribute patches (``patching``), the ``checkpoint_name``s of what a
backward keeps and the policies that choose by them (``names``), the trace-time question "what
does this layer keep?" and the path of a layer (``layer_choice``), the table of what each layer
resolved (``layer_table``), and the only use of jax's private modules (``jax_private``).
May import: jax, flax, numpy; nothing of bsr_jax.
"""
