"""The ``distillq`` command line."""
