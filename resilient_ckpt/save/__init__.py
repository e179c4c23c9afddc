"""From save() to committed manifests: the host snapshot, the tier workers, the
write order of a step, claims, the writer lock, the tiers record and cleanup of
dead writers' leftovers."""
