"""What every actor of a group says of itself when it is ready."""
from __future__ import annotations


def node_id() -> str:
    """The Ray node this actor runs on (a multi-node cluster: which host serves a model)."""
    import ray

    return ray.get_runtime_context().get_node_id()
