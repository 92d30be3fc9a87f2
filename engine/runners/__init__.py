"""Model runners: they own every tensor; the core hands them rows of ints."""
