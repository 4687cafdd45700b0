"""How a rank builds what it trains: the model (whole, or sharded from the meta device),
compiled and parallelized, and this rank's data."""
