"""HTTP servers in front of distillq's streams (``distillq serve``): ``atropos_*``, the Atropos API server;
``student_*``, the verifiers-compatible student endpoint."""
