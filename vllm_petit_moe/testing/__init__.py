"""Testing oracles and diagnostics, apart from the runtime: `reference` (the plain-torch oracle
of every kernel) and `combine_trace` (the combine timeline's summary). Tests, examples and
tools import them; the runtime modules never do."""
