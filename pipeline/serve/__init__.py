"""HTTP servers in front of distillq's streams (``distillq serve``): ``atropos``, the Atropos API server;
``student``, the verifiers-compatible student endpoint. The argparse glue of ``serve student`` is
``pipeline.cli.commands.serve_student``, beside the other commands.
"""
