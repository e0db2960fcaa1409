"""The ``distillq`` command line: ``main`` (the entry point) and ``commands`` (one module per subcommand) on top;
beside them, what the commands run: stream inspection and summaries, stats, recovery of dead letters, embedded
Redis and the supervisor of local processes. The demo lives in ``pipeline.demo``."""
