"""The core: requests, scheduling, lookahead and the step loop; plain Python over ints."""
