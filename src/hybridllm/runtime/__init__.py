"""The runtime: the model runner (walks the placement's tiers, counts hops) and the decode backends."""
