"""The ``distillq`` subcommands, one module each (``main`` adds their parsers)."""
