"""HTTP servers in front of distillq's streams (``distillq serve``): ``atropos_*``, the Atropos API server."""
