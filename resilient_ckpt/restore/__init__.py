"""From a chosen step to jax arrays: verified chunk reads with per-tier
fallback, assembly onto the target shardings, and the loop that falls back to
an older step."""
