"""mempo: MemPO search agents trained on a Ray Serve pipeline."""

import sys as _sys

if "ray.serve._private.replica" in _sys.modules:  # a Serve replica: keep its gRPC port on loopback
    from services.common.local_ray import keep_serve_grpc_on_loopback

    keep_serve_grpc_on_loopback()
