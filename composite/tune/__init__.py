"""composite.tune: placement and precision per shard, chosen by measured KL divergence under a size budget."""
