"""Rewriting a user's model without editing it: rules by module path (``rules``), routing Flax
layers and products to the compressed ops (``compress``, ``intercept``), keeping less around
norms and activations (``lean``, ``lean_graph``), per-layer schedules and sensitivities
(``schedules``, ``sensitivity``) and measured settings (``presets``).
May import: every part below ``planning``.
"""
