"""The benchmark harness: sweeps of configurations, each measured in its own process.

``sweep`` builds the grid and runs it, ``worker`` measures one configuration in a child
process (our engine or a peer from ``peers``), ``measure`` holds the method shared by every
engine, ``report`` and ``plots`` write the results, ``presets`` holds the named grids and
``random_weights`` builds our engine and transformers on the same random weights
(``hybridllm.loading.random_checkpoint``) of a published shape, without downloading any.

Nothing is imported here, so ``hybridllm --help`` stays fast: import the modules you need
(``from hybridllm.bench.sweep import BenchConfig, run_sweep``).
"""
