"""The planner (``bsr_jax.plan``) on whole models and budgets, beside JAX's remat policies."""
