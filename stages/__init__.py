"""Built-in stage kinds: dataset, collect, filter, train, evaluate."""
