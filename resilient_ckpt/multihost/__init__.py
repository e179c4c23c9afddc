"""Exchanging small views among the processes of a job, and filling shards a
process could not read from its peers' replicas."""
