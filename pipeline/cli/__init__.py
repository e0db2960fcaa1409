"""The ``distillq`` command line: ``main`` (the entry point), ``commands`` (one module per subcommand), and
what the commands run: the demo, embedded Redis, the supervisor, stream inspection and stats."""
