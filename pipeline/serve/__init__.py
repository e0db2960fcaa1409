"""HTTP servers in front of distillq's streams (``distillq serve``): ``atropos``, the Atropos API server;
``student``, the verifiers-compatible student endpoint.

The modules were flat files before (``pipeline.serve.atropos_app``, ``pipeline.serve.student_verifiers``, ...):
those paths still import the moved modules (``MOVED``). The argparse glue of ``serve student``
(``pipeline.serve.student.command``, before that ``pipeline.serve.student_cli``) is
``pipeline.cli.commands.serve_student`` now, beside the other commands.
"""

from pipeline.moved import keep_old_paths

MOVED: dict[str, str] = {
    "pipeline.serve.atropos_app": "pipeline.serve.atropos.app",
    "pipeline.serve.atropos_ingest": "pipeline.serve.atropos.ingest",
    "pipeline.serve.atropos_lock": "pipeline.serve.atropos.lock",
    "pipeline.serve.atropos_models": "pipeline.serve.atropos.bodies",
    "pipeline.serve.atropos_packing": "pipeline.serve.atropos.packing",
    "pipeline.serve.atropos_queue": "pipeline.serve.atropos.queue",
    "pipeline.serve.atropos_routes": "pipeline.serve.atropos.routes",
    "pipeline.serve.atropos_scripts": "pipeline.serve.atropos.queue_scripts",
    "pipeline.serve.atropos_server": "pipeline.serve.atropos.startup",
    "pipeline.serve.atropos_state": "pipeline.serve.atropos.state",
    "pipeline.serve.student_app": "pipeline.serve.student.app",
    "pipeline.serve.student_cli": "pipeline.cli.commands.serve_student",
    "pipeline.serve.student.command": "pipeline.cli.commands.serve_student",
    "pipeline.serve.student_requests": "pipeline.serve.student.validation",
    "pipeline.serve.student_service": "pipeline.serve.student.service",
    "pipeline.serve.student_sessions": "pipeline.serve.student.sessions",
    "pipeline.serve.student_verifiers": "pipeline.serve.student.verifiers",
}

keep_old_paths(MOVED)
