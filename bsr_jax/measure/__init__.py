"""Measuring a step: compiled peak memory and modelled time, deviceless for an H100 or a TPU
(``compiled``, ``roofline``), residual bytes and remat policies (``memory``), and the per-layer
account of what a backward keeps (``report``).
May import: ``core``, ``storage``, ``backends``, ``ops``.
"""
